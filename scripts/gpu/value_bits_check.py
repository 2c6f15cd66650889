"""Attention over a model's own keys and values, stored by codebook caches of
several key and value bits, through the CUDA kernels and through MLX ops.

    python3 scripts/gpu/value_bits_check.py --model models/gemma-3-270m --dtype bfloat16 \\
        --tokens 8192 --out $OUT/value-bits-gemma3.json

A passkey prompt (``omlx_cache.eval``'s) goes through the model with plain
caches, the server's 2,048-token step at a time; the layers that attend the
whole context keep the last step's queries with their keys and values. Each
scheme's cache of such a layer then stores those keys and values and attends
the last ``--queries`` queries, along each path (``ops``: MLX ops; ``kernels``:
the CUDA kernels, where they apply). The error is against float64 attention
over the unquantized keys and values (numpy). More value bits should give less
error along every path; on Gemma's 8K passkeys 5-bit values lost more keys
through the kernels than 4-bit ones (session 22). On CUDA both paths gave the
same error; the keys moved with TF32 rounding (docs/quality-levers.md,
session 23).
"""

import argparse
import contextlib
import json
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from omlx_cache import codebook_kernel, schemes
from omlx_cache import eval as kv_eval

SCHEMES = [
    "codebook-16k-4v+center+qscale+exact8",
    "codebook-16k-5v+center+qscale+exact8",
    "codebook-5k-4v+center+qscale+exact8",
    "codebook-5k-5v+center+qscale+exact8",
]
PATHS = {
    "ops": lambda: codebook_kernel.disabled(),
    "kernels": contextlib.nullcontext,
}


class RecordingKVCache(KVCache):
    """A plain cache that keeps the queries and scale of its last attention
    call (mlx-lm's attention defers to a cache that has
    ``scaled_dot_product_attention``)."""

    def scaled_dot_product_attention(
        self, queries, keys, values, scale, mask, sinks=None
    ):
        self.queries, self.scale = queries, scale
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )


def record(model, tokens: list[int], chunk: int) -> dict:
    """Per whole-context layer: its keys, values, last queries and scale
    after ``tokens`` go through the model in steps of ``chunk``."""
    windows = schemes.layer_windows(model)
    cache = [RecordingKVCache() for _ in windows]
    kv_eval.prefill(model, tokens, cache, chunk)
    layers = {}
    for i, (c, window) in enumerate(zip(cache, windows)):
        if window is None:
            keys, values = (x[:, :, : c.offset] for x in (c.keys, c.values))
            layers[i] = (c.queries, keys, values, c.scale)
    return layers


def reference(queries, keys, values, scale) -> np.ndarray:
    """float64 causal attention of the last queries over every key (queries
    grouped over the KV heads as mlx-lm's attention groups them)."""
    q, k, v = (
        np.array(x.astype(mx.float32), dtype=np.float64)
        for x in (queries, keys, values)
    )
    B, n_q, L, D = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    q = q.reshape(B, n_kv, n_q // n_kv, L, D)
    scores = np.einsum("bhgld,bhsd->bhgls", q, k) * scale
    visible = np.arange(S)[None] <= np.arange(S - L, S)[:, None]
    scores = np.where(visible, scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    out = np.einsum("bhgls,bhsd->bhgld", weights, v)
    return out.reshape(B, n_q, L, D)


def relative_error(out, ref: np.ndarray) -> float:
    out = np.array(out.astype(mx.float32), dtype=np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def attend(scheme, model, layer: int, queries, keys, values, scale):
    """The layer's cache of ``scheme`` holding ``keys`` and ``values``,
    attending ``queries`` (the last of a causal prefill)."""
    cache = scheme.make_cache(model)[layer]
    stored = cache.update_and_fetch(keys, values)
    return cache.scaled_dot_product_attention(queries, *stored, scale, "causal")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", choices=sorted(kv_eval.DTYPES), default=None)
    parser.add_argument(
        "--kv", action="append", help="a scheme (default: 4 codebook ones)"
    )
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length")
    parser.add_argument(
        "--queries", type=int, default=256, help="last queries attended"
    )
    parser.add_argument("--chunk", type=int, default=2048, help="prefill step")
    parser.add_argument("--depth", type=float, default=0.5, help="the key's depth")
    parser.add_argument("--out", help="write the errors as JSON")
    args = parser.parse_args()

    model, tokenizer = kv_eval.load_model(args.model)
    if args.dtype:
        model.set_dtype(kv_eval.DTYPES[args.dtype])
    bos = tokenizer.bos_token_id
    prompt = kv_eval.passkey_prompt(tokenizer, args.tokens, args.depth, "68755", bos)
    start = time.perf_counter()
    layers = record(model, prompt.tokens, args.chunk)
    on_cuda = codebook_kernel._cuda_available() and mx.default_device() == mx.gpu
    paths = ["ops", "kernels"] if on_cuda else ["ops"]
    names = args.kv or SCHEMES
    rows = []
    print(f"| layer | KV | {' | '.join(paths)} | kernels vs ops |")
    print("|---|---|" + "---|" * (len(paths) + 1))
    for layer, (queries, keys, values, scale) in layers.items():
        queries = queries[:, :, -args.queries :]
        ref = reference(queries, keys, values, scale)
        for name in names:
            scheme = schemes.get_scheme(name)
            outs = {}
            for path in paths:
                with PATHS[path]():
                    outs[path] = attend(
                        scheme, model, layer, queries, keys, values, scale
                    )
                    mx.eval(outs[path])
            errors = {path: relative_error(out, ref) for path, out in outs.items()}
            between = None
            if "kernels" in outs:
                between = relative_error(
                    outs["kernels"], np.array(outs["ops"].astype(mx.float32))
                )
            rows.append(
                {"layer": layer, "kv": name, "error": errors, "kernels_vs_ops": between}
            )
            cells = " | ".join(f"{errors[p]:.2e}" for p in paths)
            print(
                f"| {layer} | {name} | {cells} | {'' if between is None else f'{between:.2e}'} |"
            )
    if args.out:
        report = {
            "model": args.model,
            "dtype": args.dtype,
            "tokens": len(prompt.tokens),
            "queries": args.queries,
            "chunk": args.chunk,
            "device": str(mx.default_device()),
            "seconds": time.perf_counter() - start,
            "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
