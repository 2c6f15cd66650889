"""Decode speed through mlx-lm's own generation loop (GPU machine).

``generate_step`` (what ``mlx_lm.generate`` and ``stream_generate`` run)
over a random prompt at a bench preset's shape, with random 4-bit weights:
time to the first token (prefill) and decode tokens/s after it, per KV
scheme, side by side in one process. Schemes: ``fp16`` or ``B`` / ``KB,VB``
(``kv_bits``, quantized from the first token); ``/h0`` quantizes each decode
token as it comes (``QuantizedKVCache.decode_buffer = 0``, codebook caches
too), ``/slices`` has codebook caches write each held token into their
buffer as it comes instead of their decode kernel (``kernel_writes_held``),
``/r0`` leaves the cache unreserved (pages of 4,096 tokens as they fill),
``/clear`` empties MLX's buffer cache once the first token is out
(what the prefill's freed buffers do to decode), ``/qmm`` has the CPU
multiply a prefill's tiles by ``mx.quantized_matmul`` (before patch 0026,
which multiplies them dequantized). ``codebook-...``
names (``omlx_cache.schemes``, e.g. ``codebook-3``, ``codebook-3k-4v``) build
``CodebookKVCache``s whose first page holds what ``generate_step`` reserves
for a quantized cache (the prompt plus at most 4,096 new tokens; ``/r0``:
pages of 4,096 tokens).

    python3 scripts/gpu/generate_speed.py --contexts 32768 --schemes fp16 8,4 8,4/r0 \\
        --out $OUT/generate-speed.json
"""

import argparse
import contextlib
import itertools
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import base, quantized_prefill
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from omlx_cache import bench
from omlx_cache.codebook import CodebookKVCache
from omlx_cache.schemes import get_scheme


def parse(name: str):
    """(kv_bits or None, decode_buffer or None, reserve or None, kept first
    tokens, residual): options after the bits are ``h0`` (no held decode
    tokens), ``r0`` (no reservation), ``xN`` (``--kv-keep-exact N``),
    ``resN`` (``--kv-residual N``), and ``slices``, ``clear`` and ``nocopy``,
    which ``make_cache`` and ``run`` read from the name (``nocopy``: prefill
    without patch 0020's dequantized copy: the fused kernel or the MLX-ops
    path)."""
    base, *options = name.split("/")
    bits = None
    if base != "fp16" and not base.startswith("codebook"):
        bits = tuple(int(b) for b in base.split(","))
        bits = bits if len(bits) == 2 else bits[0]
    held = 0 if "h0" in options else None
    reserve = 0 if "r0" in options else None
    counts = {"x": 0, "res": 0}
    unknown = set(options) - {"h0", "slices", "r0", "nocopy", "clear", "qmm"}
    for option in sorted(unknown):
        for prefix in counts:
            if option.startswith(prefix) and option[len(prefix) :].isdigit():
                counts[prefix] = int(option[len(prefix) :])
                unknown.discard(option)
    if unknown:
        raise ValueError(f"unknown scheme options {sorted(unknown)} in {name!r}")
    return bits, held, reserve, counts["x"], counts["res"]


@contextlib.contextmanager
def cpu_quantized_matmul(on: bool):
    """Prefill tiles multiplied by ``mx.quantized_matmul`` on the CPU (on), or
    dequantized as patch 0026 has them (as is)."""
    rows = base.CPU_DEQUANTIZED_ROWS
    base.CPU_DEQUANTIZED_ROWS = 1 << 30 if on else rows
    try:
        yield
    finally:
        base.CPU_DEQUANTIZED_ROWS = rows


@contextlib.contextmanager
def prefill_copy(on: bool):
    """Patch 0020's dequantized prefill copy on (as is) or off."""
    budget = quantized_prefill.DECODED_BYTES
    quantized_prefill.DECODED_BYTES = budget if on else 0
    try:
        yield
    finally:
        quantized_prefill.DECODED_BYTES = budget


def make_cache(model, name, context, tokens):
    """The prompt cache for scheme ``name`` (``generate_step``'s own for the
    affine schemes, with their options) and its ``kv_bits``."""
    bits, held, reserve, keep_exact, residual = parse(name)
    if name.startswith("codebook"):
        cache = get_scheme(name.split("/")[0]).make_cache(model)
        for c in cache:
            if reserve == 0:
                c.page_size = CodebookKVCache.page_size
            else:
                c.page_size = context + min(tokens, 4096)
            if held == 0:
                c.decode_buffer = 0
            c.kernel_writes_held = "slices" not in name.split("/")
    else:
        cache = make_prompt_cache(
            model, kv_bits=bits, kv_keep_exact=keep_exact, kv_residual=residual
        )
        for c in cache:
            if reserve is not None:
                c.reserve = reserve
            if held is not None and isinstance(c, QuantizedKVCache):
                c.decode_buffer = held
    return cache, bits


def generation(model, prompt, cache, bits, tokens):
    """``generate_step`` as mlx-lm runs it, with 2,048-token prefill steps."""
    return generate_step(
        prompt,
        model,
        max_tokens=tokens,
        prompt_cache=cache,
        kv_bits=bits,
        prefill_step_size=2048,
    )


def run(model, name, context, tokens, vocab):
    prompt = bench.random_tokens(context, vocab, seed=context)[:, 0]
    cache, bits = make_cache(model, name, context, tokens)
    mx.clear_cache()
    mx.reset_peak_memory()
    times = []
    options = name.split("/")
    with prefill_copy("nocopy" not in options), cpu_quantized_matmul("qmm" in options):
        start = time.perf_counter()
        for _ in generation(model, prompt, cache, bits, tokens):
            times.append(time.perf_counter())
            if len(times) == 1 and "clear" in options:
                mx.clear_cache()
    steps = [b - a for a, b in itertools.pairwise(times)]
    return {
        "context": context,
        "scheme": name,
        "first_token_s": times[0] - start,
        "decode_ms_median": 1e3 * statistics.median(steps),
        "decode_tok_s": 1 / statistics.median(steps),
        # steps over their total time: what a generation gets, as a pipelined
        # loop's steps alternate long and short
        "decode_tok_s_all_steps": len(steps) / (times[-1] - times[0]),
        "pages": len(cache[0].key_pages)
        if isinstance(cache[0], (QuantizedKVCache, CodebookKVCache))
        else None,
        "peak_gib": mx.get_peak_memory() / 2**30,
        "steps_ms": [round(1e3 * x, 3) for x in steps],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(bench.PRESETS))
    parser.add_argument("--contexts", default="32768")
    parser.add_argument("--schemes", nargs="+", default=["fp16", "8,4", "4"])
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per run")
    parser.add_argument(
        "--warmup", type=int, default=4608, help="context of an untimed run"
    )
    parser.add_argument(
        "--dtype",
        choices=["float16", "bfloat16", "float32"],
        help="the model's dtype (default: the preset's; float32 suits the CPU)",
    )
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    preset = bench.PRESETS[opts.preset]
    dtype = getattr(mx, opts.dtype or preset.get("dtype", "float16"))
    model = bench.build_model(preset, dtype)
    vocab = model.args.vocab_size
    # The first run of each scheme compiles its kernels (MLX caches them on
    # disk, under MLX_PTX_CACHE_DIR): in a process with an empty cache these
    # rows are the cold start, fp16 paying for the model's own kernels.
    warmup = []
    for name in opts.schemes:
        start = time.perf_counter()
        row = run(model, name, opts.warmup, 8, vocab)
        row["total_s"] = time.perf_counter() - start
        warmup.append(row)
        print(
            f"warm-up {opts.warmup} {name:<8} first token {row['first_token_s']:.3f} s, "
            f"all {row['total_s']:.3f} s",
            flush=True,
        )
    rows = []
    for context in bench.int_list(opts.contexts):
        fp16 = affine4 = None
        for name in opts.schemes:
            row = run(model, name, context, opts.tokens, vocab)
            fp16 = row if name == "fp16" else fp16
            affine4 = row if name == "4" else affine4
            if affine4:
                # against affine 4-bit (patch 0011's kernel), in this process
                row["decode_vs_4"] = row["decode_tok_s"] / affine4["decode_tok_s"]
                row["decode_all_steps_vs_4"] = (
                    row["decode_tok_s_all_steps"] / affine4["decode_tok_s_all_steps"]
                )
                row["first_token_vs_4"] = (
                    row["first_token_s"] / affine4["first_token_s"]
                )
            for key, key_vs in (
                ("decode_tok_s", "decode_vs_fp16"),
                ("decode_tok_s_all_steps", "decode_all_steps_vs_fp16"),
            ):
                row[key_vs] = row[key] / fp16[key] if fp16 else None
            rows.append(row)
            ratio = ""
            if fp16:
                ratio = (
                    f" ({row['decode_vs_fp16']:.2f}x fp16; all steps "
                    f"{row['decode_tok_s_all_steps']:.1f} tok/s, "
                    f"{row['decode_all_steps_vs_fp16']:.2f}x)"
                )
            if affine4:
                ratio += (
                    f" [vs 4: decode {row['decode_vs_4']:.2f}x, all steps "
                    f"{row['decode_all_steps_vs_4']:.2f}x, first token "
                    f"{row['first_token_vs_4']:.2f}x]"
                )
            print(
                f"{context:>7} {name:<8} first token {row['first_token_s']:.3f} s, "
                f"decode {row['decode_tok_s']:.1f} tok/s{ratio}, "
                f"pages {row['pages']}, peak {row['peak_gib']:.2f} GiB",
                flush=True,
            )
            with open(opts.out, "w") as f:
                report = {"preset": opts.preset, "warmup": warmup, "rows": rows}
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
