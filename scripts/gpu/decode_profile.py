"""Where a decode step's time goes with a quantized KV cache (GPU machine).

A Llama-3-8B-shaped attention stack (32 layers, 32 q / 8 kv heads, D=128,
fp16), without the weights: per step and layer, the cache's
``update_and_fetch`` of one token and the attention of one query. Reported
per token (all layers), median over the steps: the time to build the graph
in Python, and build plus evaluation; for "update" (writes only), "attend"
(attention only) and "step" (both), and "pipelined": steps queued before the
previous one is waited for, as generate_step does (the interval per step).
Then the fused kernel alone at one layer, over its launch shapes (warps per
block, keys per block), with the combine kernel timed apart; ``--batch``
sequences make the device's time outweigh Python's per call.

    python3 scripts/gpu/decode_profile.py --contexts 4096,32768 --out $OUT/profile.json
"""

import argparse
import importlib.util
import json
import statistics
import time
from functools import partial

import mlx.core as mx
from mlx_lm.models import quantized_decode
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from omlx_cache.bench import pipelined_intervals

LAYERS, N_Q, N_KV, D = 32, 32, 8, 128
SCALE = D**-0.5


def parse_bits(name):
    if name == "fp16":
        return None
    bits = tuple(int(b) for b in name.split(","))
    return bits if len(bits) == 2 else bits[0]


def filled_caches(name, context, layers=LAYERS, batch=1):
    bits = parse_bits(name)
    make = KVCache if bits is None else lambda: QuantizedKVCache(64, bits)
    caches = [make() for _ in range(layers)]
    chunk = 4096
    k = mx.random.normal((batch, N_KV, chunk, D)).astype(mx.float16)
    v = mx.random.normal((batch, N_KV, chunk, D)).astype(mx.float16)
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        for c in caches:
            c.update_and_fetch(k[:, :, :n], v[:, :, :n])
        mx.eval([c.state for c in caches])
    return caches


def step_inputs(steps):
    shape = (steps, LAYERS, 1, N_KV, 1, D)
    k = mx.random.normal(shape).astype(mx.float16)
    v = mx.random.normal(shape).astype(mx.float16)
    q = mx.random.normal((steps, LAYERS, 1, N_Q, 1, D)).astype(mx.float16)
    mx.eval(k, v, q)
    return k, v, q


def layer_outputs(caches, part, k, v, q, s, fetched=None):
    """Step ``s`` over all layers: the caches' writes ("update"), attention
    over keys fetched before (``fetched``, "attend"), or both ("step")."""
    outs = []
    for i, c in enumerate(caches):
        if part == "attend":
            keys, values = fetched[i]
        else:
            keys, values = c.update_and_fetch(k[s, i], v[s, i])
        if part == "update":
            outs.append(keys[-1][0] if isinstance(keys, list) else keys)
            continue
        outs.append(
            scaled_dot_product_attention(
                q[s, i], keys, values, cache=c, scale=SCALE, mask=None
            )
        )
    return outs


def run_steps(caches, part, k, v, q):
    """Per-step (build seconds, total seconds) for ``part``."""
    times = []
    fetched = None
    if part == "attend":
        fetched = [c.update_and_fetch(k[0, i], v[0, i]) for i, c in enumerate(caches)]
        mx.eval([c.state for c in caches])
    for s in range(k.shape[0]):
        tic = time.perf_counter()
        outs = layer_outputs(caches, part, k, v, q, s, fetched)
        built = time.perf_counter()
        mx.eval(outs)
        times.append((built - tic, time.perf_counter() - tic))
    return times


def run_pipelined(caches, k, v, q):
    """Per-step intervals when each step is queued before the previous one
    is waited for, as generate_step does (reported as total_ms). The last
    step is only queued, so that every timed step had one behind it."""

    def queue(s):
        outs = layer_outputs(caches, "step", k, v, q, s)
        mx.async_eval(outs)
        return outs

    return [(0.0, t) for t in pipelined_intervals(queue, k.shape[0])]


def summarize(times, warmup=3):
    times = times[warmup:]
    return {
        "build_ms": 1e3 * statistics.median(t[0] for t in times),
        "total_ms": 1e3 * statistics.median(t[1] for t in times),
    }


def load_kernel_module(path):
    spec = importlib.util.spec_from_file_location("qd_alt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def profile_steps(opts):
    rows = []
    k, v, q = step_inputs(opts.steps)
    for context in opts.contexts:
        for name in opts.schemes:
            caches = filled_caches(name, context)
            for part in ("update", "attend", "step", "pipelined"):
                for c in caches:
                    c.trim(c.offset - context)
                row = {"context": context, "scheme": name, "part": part}
                if part == "pipelined":
                    times = run_pipelined(caches, k, v, q)
                else:
                    times = run_steps(caches, part, k, v, q)
                row.update(summarize(times))
                rows.append(row)
                print(
                    f"{context:>7} {name:>5} {part:>6}: build {row['build_ms']:.2f} ms,"
                    f" total {row['total_ms']:.2f} ms per token",
                    flush=True,
                )
            del caches
            mx.clear_cache()
    return rows


def time_calls(fn, calls=16, repeats=7):
    mx.eval(fn())
    best = float("inf")
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        best = min(best, (time.perf_counter() - tic) / calls)
    return best * 1e3


def profile_kernel(opts):
    """The kernel alone at one layer, over warps and keys per block."""
    rows = []
    B = opts.batch
    q = mx.random.normal((B, N_Q, 1, D)).astype(mx.float16)
    for context in opts.contexts:
        cache = filled_caches("8,4", context, layers=1, batch=B)[0]
        keys, values = cache.update_and_fetch(
            mx.zeros((B, N_KV, 1, D), mx.float16), mx.zeros((B, N_KV, 1, D), mx.float16)
        )
        length = cache.offset
        args = (keys, values, SCALE, length, 64, 8, 64, 4)
        k_hat = mx.concatenate(
            [mx.dequantize(*p, group_size=64, bits=8) for p in keys], axis=2
        )[:, :, :length]
        v_hat = mx.concatenate(
            [mx.dequantize(*p, group_size=64, bits=4) for p in values], axis=2
        )[:, :, :length]
        mx.eval(k_hat, v_hat)
        sdpa = time_calls(
            partial(
                mx.fast.scaled_dot_product_attention,
                q,
                k_hat,
                v_hat,
                scale=SCALE,
                mask=None,
            )
        )
        rows.append({"context": context, "batch": B, "kernel": "fp16 sdpa", "ms": sdpa})
        print(f"{context:>7} fp16 sdpa: {sdpa:.3f} ms", flush=True)
        modules = {"patched": quantized_decode}
        for path in opts.old_kernel:
            modules[path] = load_kernel_module(path)
        default_span = quantized_decode._decode_span
        for label, module in modules.items():
            ref = module.quantized_decode_attention(q, *args)
            for warps in opts.warps:
                for span in opts.spans:
                    module.WARPS = warps
                    module._decode_span = (
                        (lambda n, r, s=span: s) if span else default_span
                    )
                    out = module.quantized_decode_attention(q, *args)
                    err = mx.abs(out - ref).max().item()
                    ms = time_calls(
                        partial(module.quantized_decode_attention, q, *args)
                    )
                    row = {
                        "context": context,
                        "batch": B,
                        "kernel": label,
                        "warps": warps,
                        "span": span or "default",
                        "ms": ms,
                        "max_abs_diff_vs_default": err,
                    }
                    rows.append(row)
                    print(
                        f"{context:>7} {label} warps {warps} span {span or 'default'}:"
                        f" {ms:.3f} ms (diff {err:.1e})",
                        flush=True,
                    )
            module.WARPS = 4
            module._decode_span = default_span
        # the combine kernel alone, on partials of the default launch
        span = quantized_decode._decode_span(length, B * N_KV)
        n_blocks = -(-length // span)
        parts = (
            mx.random.normal((B * N_KV, n_blocks, 4, D)),
            mx.random.normal((B * N_KV, n_blocks, 4)),
            mx.random.uniform(shape=(B * N_KV, n_blocks, 4)),
        )
        mx.eval(parts)
        combine = partial(
            quantized_decode._combine_partials, *parts, mx.float16, (B, N_Q, 1, D)
        )
        ms = time_calls(combine)
        rows.append(
            {"context": context, "kernel": "combine", "blocks": n_blocks, "ms": ms}
        )
        print(f"{context:>7} combine of {n_blocks} partials: {ms:.3f} ms", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--schemes", nargs="+", default=["fp16", "8,4", "4"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--parts", default="steps,kernel")
    parser.add_argument("--warps", default="4")
    parser.add_argument("--spans", default="0")
    parser.add_argument(
        "--old-kernel",
        action="append",
        default=[],
        help="another quantized_decode.py to compare (repeatable)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="sequences in the kernel timings: with more, the device's time "
        "outweighs Python's per call",
    )
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    opts.contexts = [int(c) for c in opts.contexts.split(",")]
    opts.warps = [int(w) for w in opts.warps.split(",")]
    opts.spans = [int(s) for s in opts.spans.split(",")]
    result = {"device": str(mx.default_device()), "args": vars(opts)}
    parts = opts.parts.split(",")
    if "steps" in parts:
        result["steps"] = profile_steps(opts)
    if "kernel" in parts:
        result["kernel"] = profile_kernel(opts)
    with open(opts.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
