"""Passkey trials of codebook caches through each part of the CUDA kernels.

    python scripts/quality/kernel_path_passkey.py --model models/gemma-3-270m \\
        --dtype bfloat16 --kv CQ4 --context 8192 --paths ops kernels prefill-ops \\
        decode-ops prefill-f32 --out kernel-paths.json

The same prompts (``omlx_cache.eval``'s passkey prompts for ``--seed``) go
through fp16 KV once and through each scheme along each code path:

- ``ops``: the MLX-ops reference (``codebook_kernel.disabled()``);
- ``kernels``: what users run;
- ``encode-ops``, ``prefill-ops``, ``decode-ops``: the kernels but that part;
- ``prefill-f32``, ``prefill-f16``: the kernels, prefill attending float32
  or float16 keys and values (``codebook_kernel.prefill_in``);
- ``prefill-ops-local``, ``prefill-ops-global``: the kernels but prefill's in
  the layers that attend a window, or the whole context;
- ``prefill-decode-ops``: the kernels, prefill's decoding its keys and values
  by MLX ops instead of its dequantize kernel (``codebook_kernel.decoding_by_ops``).

Each path is paired with fp16 and with ``ops`` (keys lost / gained, McNemar p,
the key's mean log-probability difference and its standard error; the trials
that predict the key's digits, ``eval.passkey_trial``), so a path that costs
retrieval shows as a negative difference against ``ops``.
"""

import argparse
import contextlib
import json
import time
from pathlib import Path

import mlx.core as mx

from omlx_cache import codebook_kernel
from omlx_cache import eval as kv_eval
from omlx_cache import schemes as kv_schemes

PATHS = {
    "ops": lambda: codebook_kernel.disabled(),
    "kernels": contextlib.nullcontext,
    "encode-ops": lambda: codebook_kernel.disabled("encode"),
    "prefill-ops": lambda: codebook_kernel.disabled("prefill"),
    "decode-ops": lambda: codebook_kernel.disabled("decode"),
    "prefill-f32": lambda: codebook_kernel.prefill_in(mx.float32),
    "prefill-f16": lambda: codebook_kernel.prefill_in(mx.float16),
    "prefill-ops-local": contextlib.nullcontext,
    "prefill-ops-global": contextlib.nullcontext,
    "prefill-decode-ops": codebook_kernel.decoding_by_ops,
}
# paths that take a kernel off in some layers: (part, the layers' kind)
LAYER_PATHS = {
    "prefill-ops-local": ("prefill", "local"),
    "prefill-ops-global": ("prefill", "global"),
}


def without_kernel(attend, part):
    def attend_without(*args, **kwargs):
        with codebook_kernel.disabled(part):
            return attend(*args, **kwargs)

    return attend_without


def make_cache(model, scheme, path):
    """The scheme's caches, a kernel taken off where ``path`` says."""
    cache = scheme.make_cache(model)
    if path in LAYER_PATHS:
        part, kind = LAYER_PATHS[path]
        for c, window in zip(cache, kv_schemes.layer_windows(model)):
            if (window is None) == (kind == "global"):
                c.scaled_dot_product_attention = without_kernel(
                    c.scaled_dot_product_attention, part
                )
    return cache


def trials(model, prompts, scheme, chunk, progress, path=None):
    """The trials of ``prompts`` and the (key, value) bits per element of
    each layer's cache (``schemes.layer_bits``) after the first: fitted
    layers (``+k5@fit4.6``) may differ between machines."""
    runs, layer_bits = [], None
    for prompt in prompts:
        cache = make_cache(model, scheme, path)
        runs.append(kv_eval.passkey_trial(model, prompt, cache, chunk))
        if layer_bits is None:
            layer_bits = [kv_schemes.layer_bits(c) for c in cache]
        progress.step()
    return runs, layer_bits


def summary(runs, against) -> dict:
    vs = kv_eval.paired_outcomes(against, runs)
    vs["found"] = sum(t["correct"] for t in runs)
    vs["digits"] = sum(t["digits"] for t in runs)
    vs["digits_vs"] = kv_eval.mcnemar(against, runs, "digits")
    return vs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", choices=sorted(kv_eval.DTYPES), default=None)
    parser.add_argument("--kv", action="append", required=True, help="a scheme")
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--depths", type=int, default=8)
    parser.add_argument("--keys", type=int, default=6, help="passkeys per depth")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the trials and pairings as JSON")
    args = parser.parse_args(argv)
    if "ops" not in args.paths:
        args.paths.insert(0, "ops")

    model, tokenizer = kv_eval.load_model(args.model)
    if args.dtype:
        model.set_dtype(kv_eval.DTYPES[args.dtype])
    reference, *schemes = kv_eval.resolve_schemes(args.kv, 64)
    try:
        kv_eval.check_schemes(model, schemes)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    depths = kv_eval.passkey_depths(args.depths)
    bos = tokenizer.bos_token_id
    prompts = kv_eval.passkey_prompts(
        tokenizer, args.context, depths, args.keys, args.seed, bos
    )
    progress = kv_eval.Progress(len(prompts) * (1 + len(schemes) * len(args.paths)))
    tic = time.perf_counter()
    progress.label = reference.name
    fp16, _ = trials(model, prompts, reference, args.chunk, progress)
    results = []
    for scheme in schemes:
        by_path, layer_bits = {}, {}
        for path in args.paths:
            progress.label = f"{scheme.name} {path}"
            with PATHS[path]():
                by_path[path], layer_bits[path] = trials(
                    model, prompts, scheme, args.chunk, progress, path
                )
        for path, runs in by_path.items():
            results.append(
                {
                    "kv": scheme.name,
                    "path": path,
                    "layer_bits": [bits and list(bits) for bits in layer_bits[path]],
                    "vs_fp16": summary(runs, fp16),
                    "vs_ops": summary(runs, by_path["ops"]),
                    "runs": runs,
                }
            )
    progress.close()

    print(f"{reference.name}: {sum(t['correct'] for t in fp16)}/{len(fp16)} found")
    print(
        "| KV | path | found | vs fp16: lost / gained, Δ log-prob | vs ops: Δ log-prob "
        "| digits, vs fp16 |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        f, o = r["vs_fp16"], r["vs_ops"]
        d = f["digits_vs"]
        print(
            f"| {r['kv']} | {r['path']} | {f['found']}/{len(r['runs'])} "
            f"| {f['lost']} / {f['gained']}, {f['logprob_delta']:+.3f} "
            f"± {f['logprob_delta_se']:.3f} "
            f"| {o['logprob_delta']:+.3f} ± {o['logprob_delta_se']:.3f} "
            f"| {f['digits']}/{len(r['runs'])}, {d['lost']} / {d['gained']} |"
        )
    if args.out:
        report = {
            "model": args.model,
            "dtype": args.dtype or kv_eval.model_dtype(model),
            "context": args.context,
            "depths": depths,
            "keys": args.keys,
            "chunk": args.chunk,
            "seed": args.seed,
            "machine": kv_eval.machine(),
            "versions": kv_eval.versions(),
            "wall_seconds": time.perf_counter() - tic,
            "fp16": fp16,
            "results": results,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
