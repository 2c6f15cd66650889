"""omlx-cache: what upstream mlx-lm would not take (codecs, evaluation, benchmarks, model import)."""

__version__ = "0.1.0"
