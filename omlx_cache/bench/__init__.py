"""Speed and memory of quantized KV caches: ours and upstream mlx-lm's, side by side.

For each context length and scheme, one process measures the peak memory of a
chunked prefill (as in mlx-lm's ``generate_step``), the cache's bytes and the
decode speed at that context, twice: evaluating each step before building the
next ("decode"), and queueing the next step before waiting for the previous
one, as ``generate_step`` does ("pipelined", where Python's graph building
overlaps the device). Upstream schemes run the unpatched mlx-lm
(``vendor/pristine``, extracted from the vendored repo's ``upstream`` tag)
with the same weights as the patched model.

    python -m omlx_cache.bench                      # CPU-sized, a few minutes
    python -m omlx_cache.bench --preset llama3-8b --contexts 4096,32768 \\
        --out bench.json --plot-dir docs/data --plot-prefix bench-gpu
    python -m omlx_cache.bench --merge a.json b.json --out all.json
    python -m omlx_cache.bench --preset llama3-8b --batch 8 --fill synthetic \
        --schemes fp16 8,4 4       # batched decode, as the server batches streams

Schemes: ``fp16`` (mlx-lm's ``KVCache``, in the model's dtype), ``upstream-B``
(upstream's ``QuantizedKVCache`` from the first token), ``upstream-B@S``
(upstream's default path: ``KVCache`` until S tokens, then converted), and
ours: any scheme of ``omlx_cache.kv.spec`` (as ``python -m omlx_cache.eval
--kv`` takes them), e.g. ``8,4``, ``4``, ``bits=4 first=0`` or
``codec=codebook bits=3``, in ``KVStore``s that reserve the whole context up
front, as ``generate_step`` does (``--page-size`` sets their page size).

The parts: ``models`` (presets, the patched and pristine llama), ``caches``
(scheme names and their caches), ``timing`` (one case: fill, decode loops,
errors), ``run`` (the grid, budgets, JSON, command line) and ``report``
(tables, plots, merge).
"""

from .caches import (
    DEFAULT_SCHEMES,
    Scheme,
    left_padding,
    make_cache,
    page_size,
    parse_scheme,
    setting,
)
from .common import GIB, MIB, int_list, log, write_json
from .models import PRESETS, build_model, build_models, import_pristine, lm_head
from .report import find, markdown_table, merge, plot, report_markdown
from .run import bench, main, parse_args, run_bench
from .timing import (
    decode,
    decode_pipelined,
    pipelined_intervals,
    prefill,
    random_tokens,
    run_case,
    synthetic_fill,
)

__all__ = [
    "DEFAULT_SCHEMES",
    "GIB",
    "MIB",
    "PRESETS",
    "Scheme",
    "bench",
    "build_model",
    "build_models",
    "decode",
    "decode_pipelined",
    "find",
    "import_pristine",
    "int_list",
    "left_padding",
    "lm_head",
    "log",
    "main",
    "make_cache",
    "markdown_table",
    "merge",
    "page_size",
    "parse_args",
    "parse_scheme",
    "pipelined_intervals",
    "plot",
    "prefill",
    "random_tokens",
    "report_markdown",
    "run_bench",
    "run_case",
    "setting",
    "synthetic_fill",
    "write_json",
]
