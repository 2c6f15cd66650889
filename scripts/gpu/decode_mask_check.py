"""Batched decode with left padding on the GPU machine: the fused kernel with
a boolean mask against float32 attention (correctness) and against fp16 SDPA
with the same mask over the dequantized cache (speed), at one layer of a
Llama-3-8B shape (32 q / 8 kv heads, D=128, 8,4 cache).

    python3 scripts/gpu/decode_mask_check.py --batch 8 --contexts 4096,32768 --out $OUT/mask.json
"""

import argparse
import json
import time
from functools import partial

import mlx.core as mx
from decode_kernel_check import dequantized
from mlx_lm.models import quantized_decode
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache

N_Q, N_KV, D = 32, 8, 128
SCALE = D**-0.5


def filled_cache(bits, context, batch):
    """One layer's quantized cache (group 64) holding ``context`` random keys
    and values per sequence."""
    cache = QuantizedKVCache(64, bits)
    chunk = 4096
    k = mx.random.normal((batch, N_KV, chunk, D)).astype(mx.float16)
    v = mx.random.normal((batch, N_KV, chunk, D)).astype(mx.float16)
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        cache.update_and_fetch(k[:, :, :n], v[:, :, :n])
        mx.eval(cache.state)
    return cache


def time_calls(fn, calls=16, repeats=7):
    """ms per call of ``fn``, best of ``repeats`` batches of ``calls``."""
    mx.eval(fn())
    best = float("inf")
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        best = min(best, (time.perf_counter() - tic) / calls)
    return best * 1e3


def check(context, batch, padding_step):
    cache = filled_cache((8, 4), context, batch)
    cache.decode_buffer = 0  # the decode token quantized, as the reference reads it
    zeros = mx.zeros((batch, N_KV, 1, D), mx.float16)
    keys, values = cache.update_and_fetch(zeros, zeros)
    length = cache.offset
    q = mx.random.normal((batch, N_Q, 1, D)).astype(mx.float16)
    padding = padding_step * mx.arange(batch)
    mask = (mx.arange(length)[None] >= padding[:, None])[:, None, None]
    k_hat = dequantized(keys, 64, 8, length)
    v_hat = dequantized(values, 64, 4, length)
    mx.eval(k_hat, v_hat, mask)

    attend = partial(scaled_dot_product_attention, q, keys, values, cache=cache)
    ref = mx.fast.scaled_dot_product_attention(
        *(x.astype(mx.float32) for x in (q, k_hat, v_hat)), scale=SCALE, mask=mask
    )
    out = attend(scale=SCALE, mask=mask).astype(mx.float32)
    rel_err = (mx.linalg.norm(out - ref) / mx.linalg.norm(ref)).item()
    sdpa = partial(mx.fast.scaled_dot_product_attention, q, k_hat, v_hat)
    return {
        "context": context,
        "batch": batch,
        "kernel_applies": quantized_decode.applies(q, mask, keys, values, 8, 4, length),
        "rel_err": rel_err,
        "fp16_sdpa_masked_ms": time_calls(partial(sdpa, scale=SCALE, mask=mask)),
        "kernel_masked_ms": time_calls(partial(attend, scale=SCALE, mask=mask)),
        "kernel_unmasked_ms": time_calls(partial(attend, scale=SCALE, mask=None)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--padding-step", type=int, default=37, help="keys per row")
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    rows = []
    for context in (int(c) for c in opts.contexts.split(",")):
        rows.append(check(context, opts.batch, opts.padding_step))
        print(json.dumps(rows[-1]), flush=True)
        mx.clear_cache()
    with open(opts.out, "w") as f:
        json.dump({"device": str(mx.default_device()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
