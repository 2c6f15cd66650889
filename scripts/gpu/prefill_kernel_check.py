"""The fused CUDA prefill kernel on the GPU machine: correctness against float32
attention over the cache's content (scales and biases applied in float32),
the MLX-ops fallback in half precision, and one layer's time for a prefill
chunk against fp16 SDPA. One process; JSON out.

    python3 scripts/gpu/prefill_kernel_check.py --out $OUT/prefill.json \\
        [--parts correctness,ops,speed,memory] [--head-dims 64,128,256]
"""

import argparse
import json
import time
from functools import partial

import mlx.core as mx
from mlx_lm.models import base, quantized_prefill

DTYPES = {"f16": mx.float16, "bf16": mx.bfloat16, "f32": mx.float32}

# D, n_q_heads, n_kv_heads, (key bits, group), (value bits, group), keys,
# queries (the last positions), batch, dtype, page size, mask
CASES = [
    (128, 32, 8, (8, 64), (4, 64), 2048, 2048, 1, "f16", 4096, "causal"),
    (128, 32, 8, (8, 64), (4, 64), 9000, 2048, 1, "f16", 4096, "causal"),
    (128, 32, 8, (4, 64), (4, 64), 5000, 300, 1, "bf16", 4096, "causal"),
    (128, 32, 8, (8, 64), (8, 64), 3000, 77, 2, "f16", 4000, "causal"),
    (128, 8, 8, (4, 32), (2, 32), 777, 777, 1, "f16", 1024, "causal"),
    (128, 64, 8, (8, 128), (4, 32), 4096, 1000, 1, "bf16", 4096, "causal"),
    (128, 32, 8, (8, 64), (4, 64), 1000, 16, 1, "f16", 4096, None),
    (64, 9, 3, (8, 64), (4, 64), 300, 300, 1, "f16", 4096, "causal"),
    (64, 9, 3, (8, 32), (4, 32), 4097, 129, 2, "f16", 4096, "causal"),
    (64, 4, 1, (2, 32), (2, 32), 1000, 100, 1, "f16", 4096, "causal"),
    (64, 4, 2, (8, 64), (8, 64), 500, 50, 1, "f32", 4096, "causal"),
    (64, 4, 1, (4, 64), (4, 64), 20 * 256 - 5, 200, 1, "f16", 256, "causal"),
    (256, 16, 2, (8, 64), (4, 64), 2000, 500, 1, "bf16", 4096, "causal"),
    (256, 8, 4, (4, 128), (8, 128), 4097, 64, 1, "f16", 4096, "causal"),
]


def make_pages(x, group_size, bits, page_size):
    """Quantized pages; the tail past the keys is loud noise, which the
    kernel must not read."""
    pages = []
    for start in range(0, x.shape[2], page_size):
        chunk = x[:, :, start : start + page_size]
        if chunk.shape[2] < page_size:
            shape = (*chunk.shape[:2], page_size - chunk.shape[2], chunk.shape[3])
            noise = 50 * mx.random.normal(shape).astype(x.dtype)
            chunk = mx.concatenate([chunk, noise], axis=2)
        pages.append(tuple(mx.quantize(chunk, group_size=group_size, bits=bits)))
    return pages


def exact(pages, group_size, bits, length):
    """What the pages hold, in float32."""
    full = [
        mx.dequantize(
            p[0],
            p[1].astype(mx.float32),
            p[2].astype(mx.float32),
            group_size=group_size,
            bits=bits,
        )
        for p in pages
    ]
    return mx.concatenate(full, axis=2)[:, :, :length]


def relative_error(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def inputs(case, seed=0):
    D, n_q, n_kv, (kb, kg), (vb, vg), T, L, B, dtype, page, mask = case
    dtype = DTYPES[dtype]
    keys = mx.random.normal((B, n_kv, T, D), key=mx.random.key(seed))
    keys = keys + 2 * mx.random.normal((1, n_kv, 1, D), key=mx.random.key(seed + 1))
    values = mx.random.normal((B, n_kv, T, D), key=mx.random.key(seed + 2))
    queries = mx.random.normal((B, n_q, L, D), key=mx.random.key(seed + 3))
    k_pages = make_pages(keys.astype(dtype), kg, kb, page)
    v_pages = make_pages(values.astype(dtype), vg, vb, page)
    ref = mx.fast.scaled_dot_product_attention(
        queries.astype(dtype).astype(mx.float32),
        exact(k_pages, kg, kb, T),
        exact(v_pages, vg, vb, T),
        scale=D**-0.5,
        mask=mask,
    )
    return queries.astype(dtype), k_pages, v_pages, ref


def save(report, path):
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def case_row(case):
    D, n_q, n_kv, kbits, vbits, T, L, B, dtype, page, mask = case
    return {
        "D": D,
        "heads": [n_q, n_kv],
        "bits": [kbits[0], vbits[0]],
        "group_size": [kbits[1], vbits[1]],
        "keys": T,
        "queries": L,
        "batch": B,
        "dtype": dtype,
        "page_size": page,
        "mask": mask,
    }


def correctness(report, path):
    report["correctness"] = []
    for case in CASES:
        D, _, _, (kb, kg), (vb, vg), T, _, _, _, _, mask = case
        q, k_pages, v_pages, ref = inputs(case)
        row = case_row(case)
        row["applies"] = quantized_prefill.applies(q, mask, k_pages, v_pages, kb, vb, T)
        out = quantized_prefill.quantized_prefill_attention(
            q, k_pages, v_pages, D**-0.5, T, kg, kb, vg, vb, mask=mask
        )
        row["rel_err"] = relative_error(out, ref)
        row["dtype_ok"] = out.dtype == q.dtype
        if q.dtype != mx.float32:
            decoded = quantized_prefill.decoded_attention(
                q, k_pages, v_pages, D**-0.5, T, kg, kb, vg, vb, mask=mask
            )
            row["decoded_rel_err"] = relative_error(decoded, ref)
        print(row, flush=True)
        report["correctness"].append(row)
        save(report, path)
    worst = max(r["rel_err"] for r in report["correctness"])
    report["worst_rel_err"] = worst
    rows = report["correctness"]
    report["worst_decoded_rel_err"] = max(
        r["decoded_rel_err"] for r in rows if "decoded_rel_err" in r
    )
    save(report, path)
    print(f"worst relative error against float32: {worst:.2e}", flush=True)
    print(f"dequantized copy + SDPA: {report['worst_decoded_rel_err']:.2e}", flush=True)


def ops(report, path):
    """The MLX-ops path on this device (float32 scores) against the same
    reference and against the kernel, one small case per dtype."""
    report["ops"] = []
    for dtype in ("f16", "bf16"):
        case = (128, 32, 8, (8, 64), (4, 64), 1000, 64, 1, dtype, 4096, "causal")
        D, _, _, (kb, kg), (vb, vg), T, _, _, _, _, mask = case
        q, k_pages, v_pages, ref = inputs(case, seed=7)
        row = case_row(case)
        try:
            out = base._quantized_sdpa_ops(
                q, k_pages, v_pages, D**-0.5, mask, kg, kb, vg, vb, T
            )
            kernel = quantized_prefill.quantized_prefill_attention(
                q, k_pages, v_pages, D**-0.5, T, kg, kb, vg, vb, mask=mask
            )
            row["rel_err"] = relative_error(out, ref)
            row["kernel_vs_ops"] = relative_error(kernel, out)
        except (RuntimeError, ValueError) as error:  # what this device cannot do
            row["error"] = str(error)[:300]
        print(row, flush=True)
        report["ops"].append(row)
        save(report, path)


def per_call_ms(fn, n=4, reps=5):
    for _ in range(2):
        mx.eval(fn())
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval([fn() for _ in range(n)])
        best = min(best, (time.perf_counter() - start) / n)
    return round(best * 1e3, 3)


def speed(report, path, contexts, head_dims=(128,)):
    """One layer, 32 q / 8 kv heads, D=128 (and the other ``head_dims``): the
    last 2,048 positions of a context attend (causal) to all of it, as a
    prefill chunk does; fp16 SDPA, the kernel and the dequantized copy."""
    report["speed"] = []
    n_q, n_kv, L = 32, 8, 2048
    for D, T in ((D, T) for D in head_dims for T in contexts):
        q = mx.random.normal((1, n_q, L, D)).astype(mx.float16)
        k = mx.random.normal((1, n_kv, T, D)).astype(mx.float16)
        v = mx.random.normal((1, n_kv, T, D)).astype(mx.float16)
        mx.eval(q, k, v)
        row = {"context": T, "queries": L, "head_dim": D}
        sdpa = partial(
            mx.fast.scaled_dot_product_attention, q, k, v, scale=D**-0.5, mask="causal"
        )
        row["fp16_sdpa_ms"] = per_call_ms(sdpa)
        for kb, vb in ((8, 4), (4, 4), (8, 8)):
            k_pages = [tuple(mx.quantize(k, group_size=64, bits=kb))]
            v_pages = [tuple(mx.quantize(v, group_size=64, bits=vb))]
            mx.eval(k_pages, v_pages)
            kernel = partial(
                quantized_prefill.quantized_prefill_attention,
                *(q, k_pages, v_pages, D**-0.5, T, 64, kb, 64, vb),
                mask="causal",
            )
            row[f"kernel_{kb},{vb}_ms"] = per_call_ms(kernel)
            decoded = partial(
                quantized_prefill.decoded_attention,
                *(q, k_pages, v_pages, D**-0.5, T, 64, kb, 64, vb),
                mask="causal",
            )
            row[f"decoded_{kb},{vb}_ms"] = per_call_ms(decoded)
        flops = 4 * n_q * D * L * (T - L / 2)
        row["fp16_sdpa_tflops"] = round(flops / row["fp16_sdpa_ms"] / 1e9, 1)
        row["kernel_8,4_tflops"] = round(flops / row["kernel_8,4_ms"] / 1e9, 1)
        print(row, flush=True)
        report["speed"].append(row)
        save(report, path)
        del q, k, v
        mx.clear_cache()


def memory(report, path, context=131072):
    """One layer's prefill call at ``context`` keys (2,048 queries, 32 q / 8
    kv heads, D=128) through ``base.quantized_scaled_dot_product_attention``:
    the memory it adds while it runs and its time, for the fused kernel and
    for the dequantized copy under several ``DECODED_BYTES``."""
    report["memory"] = []
    n_q, n_kv, D, L = 32, 8, 128, 2048
    q = mx.random.normal((1, n_q, L, D)).astype(mx.float16)
    default = quantized_prefill.DECODED_BYTES
    for kb, vb in ((4, 4), (8, 4)):
        k_pages, v_pages = (
            [tuple(mx.quantize(x.astype(mx.float16), group_size=64, bits=b))]
            for x, b in (
                (mx.random.normal((1, n_kv, context, D)), kb),
                (mx.random.normal((1, n_kv, context, D)), vb),
            )
        )
        mx.eval(q, k_pages, v_pages)
        for budget in (0, 1 << 30, 1 << 28, 1 << 26):
            quantized_prefill.DECODED_BYTES = budget
            for _ in range(3):
                mx.synchronize()
                before = mx.get_active_memory()
                mx.reset_peak_memory()
                start = time.perf_counter()
                out = base.quantized_scaled_dot_product_attention(
                    q, k_pages, v_pages, D**-0.5, "causal", 64, kb, 64, vb, context
                )
                mx.eval(out)
                ms = (time.perf_counter() - start) * 1e3
                added = mx.get_peak_memory() - before
                del out
            row = {
                "bits": [kb, vb],
                "context": context,
                "path": "kernel" if budget == 0 else "decoded",
                "decoded_bytes": budget,
                "added_mib": added / 2**20,
                "ms": round(ms, 2),
            }
            print(row, flush=True)
            report["memory"].append(row)
            save(report, path)
        quantized_prefill.DECODED_BYTES = default
        del k_pages, v_pages
        mx.clear_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="prefill-kernel.json")
    parser.add_argument("--parts", default="correctness,ops,speed")
    parser.add_argument("--contexts", default="4096,32768,131072")
    parser.add_argument("--head-dims", default="128")
    args = parser.parse_args()
    report = {"device": str(mx.default_device()), "mlx": mx.__version__}
    contexts = [int(c) for c in args.contexts.split(",")]
    head_dims = [int(d) for d in args.head_dims.split(",")]
    parts = {
        "correctness": correctness,
        "ops": ops,
        "speed": partial(speed, contexts=contexts, head_dims=head_dims),
        "memory": memory,
    }
    for name in args.parts.split(","):
        if name not in parts:
            parser.error(f"unknown part {name!r}: choose from {', '.join(parts)}")
        parts[name](report, args.out)


if __name__ == "__main__":
    main()
