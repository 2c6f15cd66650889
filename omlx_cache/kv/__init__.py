"""A quantized KV store composed of a codec pair, a transform, spans and a
layout, with one attention driver (see docs/design.md)."""

from .codecs import Affine, Codebook, Plain, codec
from .store import BatchKVStore, KVStore

__all__ = ["Affine", "BatchKVStore", "Codebook", "KVStore", "Plain", "codec"]
