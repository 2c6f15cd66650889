"""The fused CUDA decode kernel (patch 0008) on the GPU machine: correctness
against float32 attention over the dequantized cache, per-layer timings
against fp16 SDPA and the bytes floor, and a check of MLX CUDA's
quantized_matmul at attention shapes. One process; JSON out.

    python3 scripts/gpu/decode_kernel_check.py --out $OUT/kernel.json [--parts correctness,speed,qmm]
"""

import argparse
import json
import time
from functools import partial

import mlx.core as mx
from mlx_lm.models import quantized_decode

PAGE = 4096
BANDWIDTH = 3.35e12  # H100 SXM HBM3, bytes/s

# D, n_q_heads, n_kv_heads, key bits, key group, value bits, value group, T, B, dtype
CASES = [
    (128, 32, 8, 8, 64, 4, 64, 1, 1, mx.float16),
    (128, 32, 8, 8, 64, 4, 64, 300, 2, mx.float16),
    (128, 32, 8, 8, 64, 4, 64, 4097, 1, mx.float16),
    (128, 32, 8, 8, 64, 4, 64, 9000, 1, mx.float16),
    (128, 32, 8, 8, 64, 4, 64, 33000, 1, mx.float16),
    (128, 32, 8, 4, 64, 4, 64, 9000, 1, mx.bfloat16),
    (128, 32, 8, 8, 64, 8, 64, 5000, 2, mx.float16),
    (128, 8, 8, 4, 32, 2, 32, 777, 1, mx.float16),
    (128, 64, 8, 8, 128, 4, 32, 4096, 1, mx.bfloat16),
    (64, 9, 3, 8, 64, 4, 64, 300, 1, mx.float16),
    (64, 9, 3, 8, 32, 4, 32, 4097, 2, mx.float16),
    (64, 9, 3, 4, 64, 4, 64, 9000, 1, mx.float16),
    (64, 4, 1, 2, 32, 4, 32, 1000, 1, mx.float16),
    (256, 16, 2, 8, 64, 4, 64, 2000, 1, mx.bfloat16),
    (256, 8, 4, 4, 128, 8, 128, 4097, 1, mx.float16),
    # 34 pages: two launches and the combine kernel
    (64, 4, 1, 4, 64, 4, 64, 33 * 4096 + 5, 1, mx.float16),
]


def make_pages(x, group_size, bits):
    """Quantized pages of PAGE tokens; the tail past the length is loud
    noise, which the kernel must not read."""
    pages = []
    for start in range(0, x.shape[2], PAGE):
        chunk = x[:, :, start : start + PAGE]
        if chunk.shape[2] < PAGE:
            shape = (*chunk.shape[:2], PAGE - chunk.shape[2], chunk.shape[3])
            noise = 50 * mx.random.normal(shape).astype(x.dtype)
            chunk = mx.concatenate([chunk, noise], axis=2)
        pages.append(tuple(mx.quantize(chunk, group_size=group_size, bits=bits)))
    return pages


def dequantized(pages, group_size, bits, length):
    full = [mx.dequantize(*p, group_size=group_size, bits=bits) for p in pages]
    return mx.concatenate(full, axis=2)[:, :, :length]


def reference(q, k, v, scale):
    repeats = q.shape[1] // k.shape[1]
    k = mx.repeat(k.astype(mx.float32), repeats, axis=1)
    v = mx.repeat(v.astype(mx.float32), repeats, axis=1)
    scores = (q.astype(mx.float32) * scale) @ k.swapaxes(-1, -2)
    return mx.softmax(scores, axis=-1) @ v


def relative_error(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def save(report, path):
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def correctness(report, path):
    mx.random.seed(0)
    report["correctness"] = []
    for D, n_q, n_kv, kb, kg, vb, vg, T, B, dtype in CASES:
        q = mx.random.normal((B, n_q, 1, D)).astype(dtype)
        k = mx.random.normal((B, n_kv, T, D)) + 2 * mx.random.normal((1, n_kv, 1, D))
        k = k.astype(dtype)
        v = mx.random.normal((B, n_kv, T, D)).astype(dtype)
        k_pages, v_pages = make_pages(k, kg, kb), make_pages(v, vg, vb)
        if not quantized_decode.applies(q, None, k_pages, v_pages, kb, vb, T):
            raise SystemExit("the decode kernel does not apply here (no CUDA?)")
        out = quantized_decode.quantized_decode_attention(
            q, k_pages, v_pages, D**-0.5, T, kg, kb, vg, vb
        )
        ref = reference(
            q, dequantized(k_pages, kg, kb, T), dequantized(v_pages, vg, vb, T), D**-0.5
        )
        row = {
            "D": D,
            "n_q_heads": n_q,
            "n_kv_heads": n_kv,
            "bits": [kb, vb],
            "group_size": [kg, vg],
            "tokens": T,
            "batch": B,
            "dtype": str(dtype),
            "rel_err": relative_error(out, ref),
        }
        print(row, flush=True)
        report["correctness"].append(row)
        save(report, path)
    worst = max(r["rel_err"] for r in report["correctness"])
    print(f"worst relative error against float32: {worst:.2e}")


def per_call_ms(fn, n=16, reps=5):
    """(graph build, evaluation) ms per call, n calls per evaluation, best of reps."""
    for _ in range(3):
        mx.eval(fn())
    build = run = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(n)]
        t1 = time.perf_counter()
        mx.eval(outs)
        t2 = time.perf_counter()
        build, run = min(build, (t1 - t0) / n), min(run, (t2 - t1) / n)
    return round(build * 1e3, 4), round(run * 1e3, 4)


def speed(report, path):
    report["speed"] = []
    B, n_q, n_kv, D = 1, 32, 8, 128
    for T in (4096, 32768, 131072):
        q = mx.random.normal((B, n_q, 1, D)).astype(mx.float16)
        k = mx.random.normal((B, n_kv, T, D)).astype(mx.float16)
        v = mx.random.normal((B, n_kv, T, D)).astype(mx.float16)
        mx.eval(q, k, v)
        row = {"tokens": T}
        row["fp16_sdpa"] = per_call_ms(
            partial(mx.fast.scaled_dot_product_attention, q, k, v, scale=D**-0.5)
        )
        for kb, vb in ((8, 4), (4, 4), (8, 8)):
            k_pages, v_pages = make_pages(k, 64, kb), make_pages(v, 64, vb)
            mx.eval(k_pages, v_pages)
            kernel = partial(
                quantized_decode.quantized_decode_attention,
                *(q, k_pages, v_pages, D**-0.5, T, 64, kb, 64, vb),
            )
            row[f"kernel_{kb},{vb}"] = per_call_ms(kernel)
            kv_bytes = sum(x.nbytes for p in k_pages + v_pages for x in p)
            row[f"floor_{kb},{vb}"] = round(kv_bytes / BANDWIDTH * 1e3, 4)
        print(row, flush=True)
        report["speed"].append(row)
        save(report, path)


def qmm_check(report, path):
    """MLX CUDA quantized_matmul against a dequantized matmul."""
    report["qmm"] = []
    mx.random.seed(1)
    for D, n_kv, rows in ((64, 3, 3), (64, 3, 512), (128, 8, 4)):
        for bits, group_size in ((8, 64), (4, 32), (8, 128)):
            if group_size > D:
                continue
            for transpose in (True, False):
                w = mx.random.normal((1, n_kv, 256, D)).astype(mx.float16)
                wq = mx.quantize(w, group_size=group_size, bits=bits)
                w_hat = mx.dequantize(*wq, group_size=group_size, bits=bits)
                w_hat = w_hat.astype(mx.float32)
                if transpose:
                    x = mx.random.normal((1, n_kv, rows, D)).astype(mx.float16)
                    ref = x.astype(mx.float32) @ w_hat.swapaxes(-1, -2)
                else:
                    x = mx.softmax(mx.random.normal((1, n_kv, rows, 256)), axis=-1)
                    x = x.astype(mx.float16)
                    ref = x.astype(mx.float32) @ w_hat
                y = mx.quantized_matmul(
                    x, *wq, transpose=transpose, group_size=group_size, bits=bits
                )
                row = {
                    "D": D,
                    "n_kv_heads": n_kv,
                    "rows": rows,
                    "bits": bits,
                    "group_size": group_size,
                    "transpose": transpose,
                    "rel_err": relative_error(y, ref),
                }
                print(row, flush=True)
                report["qmm"].append(row)
                save(report, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="decode-kernel.json")
    parser.add_argument("--parts", default="correctness,speed,qmm")
    args = parser.parse_args()
    report = {"device": str(mx.default_device()), "mlx": mx.__version__}
    parts = {"correctness": correctness, "speed": speed, "qmm": qmm_check}
    for name in args.parts.split(","):
        if name not in parts:
            parser.error(f"unknown part {name!r}: choose from {', '.join(parts)}")
        parts[name](report, args.out)


if __name__ == "__main__":
    main()
