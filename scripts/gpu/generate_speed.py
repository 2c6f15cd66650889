"""First token and decode speed through mlx-lm's own generation loop (GPU machine).

``generate_step`` (what ``mlx_lm.generate`` and ``stream_generate`` run)
over a random prompt at a bench preset's shape, with random 4-bit weights:
time to the first token (prefill) and decode tokens/s after it, per KV
scheme, side by side in one process. Schemes: ``fp16`` (mlx-lm's own
caches), ``upstream-B`` (mlx-lm's ``kv_bits``, as the patched release
quantizes), or any ``omlx_cache.kv.spec`` scheme (``4``, ``8,4``,
``bits=4 rotate=none first=0``, ``codec=codebook bits=3``...), whose stores
reserve the prompt and up to 4,096 new tokens, as ``generate_step`` does.
A scheme may end in ``/ops``: the MLX-ops attention only (no CUDA kernel).

    python3 scripts/gpu/generate_speed.py --contexts 32768 --schemes fp16 8,4 4 \\
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
from mlx_lm.models.cache import make_prompt_cache

from omlx_cache import bench
from omlx_cache.kv import kernels
from omlx_cache.kv.spec import KVSpec


def make_cache(model, name, context, tokens):
    """The prompt cache for scheme ``name`` and the ``kv_bits`` to pass."""
    base = name.split("/")[0]
    if base == "fp16":
        return make_prompt_cache(model), None
    if base.startswith("upstream-"):
        return make_prompt_cache(model), int(base.removeprefix("upstream-"))
    cache = KVSpec.parse(base).make_cache(model)
    for c in cache:
        # as generate_step reserves the generation's page
        c.reserve = context + min(tokens, 4096)
    return cache, None


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
    ops = kernels.disabled() if name.endswith("/ops") else contextlib.nullcontext()
    with ops:
        start = time.perf_counter()
        for _ in generation(model, prompt, cache, bits, tokens):
            times.append(time.perf_counter())
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
        "pages": len(getattr(cache[0], "key_pages", [])) or None,
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
