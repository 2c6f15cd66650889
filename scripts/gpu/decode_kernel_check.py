"""The affine CUDA decode kernel (``omlx_cache.kernels.affine_decode``,
registered as ``affine-decode``) through ``omlx_cache.kv`` stores on the GPU
machine: correctness of a ``KVStore`` of two ``Affine`` codecs (one query
token; the tokens it holds, first tokens kept, several pages and launches,
loud noise past the stored rows) through the kernel and through
``omlx_cache.kv.kernels.disabled()`` (the MLX-ops loop), each against
float32 attention over what the store holds; per-layer timings against fp16
SDPA and the bytes floor; and a check of MLX CUDA's quantized_matmul at
attention shapes. One process; JSON out.

    python3 scripts/gpu/decode_kernel_check.py --out $OUT/kernel.json [--parts correctness,sinks,speed,qmm]

``--dry-run`` runs the same code on the CPU at small shapes, through the
MLX-ops loop (no kernel applies there): it checks the script, not the kernel.
"""

import argparse
from functools import partial

import mlx.core as mx
from kv_check import (
    Report,
    add_dry_run,
    compare,
    fill,
    l2_error,
    ms_per_call,
    noisy_tail,
    start,
    worst,
)

from omlx_cache.kv import Affine, KVStore

PAGE = 4096

# D, n_q_heads, n_kv_heads, key bits, key group, value bits, value group, T, B,
# dtype, first tokens kept, decode tokens held
CASES = [
    (128, 32, 8, 8, 64, 4, 64, 1, 1, mx.float16, 0, 0),
    (128, 32, 8, 8, 64, 4, 64, 300, 2, mx.float16, 0, 0),
    (128, 32, 8, 8, 64, 4, 64, 4097, 1, mx.float16, 0, 5),
    (128, 32, 8, 8, 64, 4, 64, 9000, 1, mx.float16, 16, 0),
    (128, 32, 8, 8, 64, 4, 64, 33000, 1, mx.float16, 0, 31),
    (128, 32, 8, 4, 64, 4, 64, 9000, 1, mx.bfloat16, 16, 7),
    (128, 32, 8, 8, 64, 8, 64, 5000, 2, mx.float16, 0, 3),
    (128, 8, 8, 4, 32, 2, 32, 777, 1, mx.float16, 0, 0),
    (128, 64, 8, 8, 128, 4, 32, 4096, 1, mx.bfloat16, 0, 0),
    (64, 9, 3, 8, 64, 4, 64, 300, 1, mx.float16, 4, 2),
    (64, 9, 3, 8, 32, 4, 32, 4097, 2, mx.float16, 0, 0),
    (64, 9, 3, 4, 64, 4, 64, 9000, 1, mx.float16, 0, 0),
    (64, 4, 1, 2, 32, 4, 32, 1000, 1, mx.float16, 0, 0),
    (256, 16, 2, 8, 64, 4, 64, 2000, 1, mx.bfloat16, 8, 4),
    (256, 8, 4, 4, 128, 8, 128, 4097, 1, mx.float16, 0, 0),
    # 34 pages: two launches and the combine kernel
    (64, 4, 1, 4, 64, 4, 64, 33 * 4096 + 5, 1, mx.float16, 0, 0),
]
# attention sinks (GPT-OSS: D 64, 64 q / 8 kv heads): D, n_q_heads, n_kv_heads,
# T, B, first tokens kept, decode tokens held, centered keys
SINK_CASES = [
    (64, 64, 8, 5000, 1, 0, 0, False),
    (64, 64, 8, 9000, 2, 16, 3, True),
    (128, 32, 8, 4097, 1, 32, 5, True),
]
DRY_SINK_CASES = [(64, 4, 2, 100, 2, 4, 3, True)]
DRY_CASES = [
    (64, 4, 2, 8, 64, 4, 64, 100, 1, mx.float16, 0, 0),
    (64, 6, 2, 4, 32, 8, 64, 70, 2, mx.float16, 4, 3),
]


def sinks_correctness(report, cases, page):
    """4-bit keys and values (centered keys shift the sinks' logits)."""
    mx.random.seed(1)
    for D, n_q, n_kv, T, B, first, held, center in cases:
        store = KVStore(
            Affine(4, 64, "hadamard"),
            Affine(4, 64, "hadamard"),
            first=first,
            center="k" if center else None,
            page_size=page,
        )
        keys = mx.random.normal((B, n_kv, T, D)) + 2 * mx.random.normal((1, n_kv, 1, D))
        values = mx.random.normal((B, n_kv, T, D))
        fill(store, keys.astype(mx.float16), values.astype(mx.float16), decode=held)
        q = mx.random.normal((B, n_q, 1, D)).astype(mx.float16)
        sinks = 2 * mx.random.normal((n_q,)) + 4
        row = {"D": D, "n_q_heads": n_q, "tokens": T, "batch": B, "first": first}
        row.update(held=store.spans.n_held, centered=center)
        row.update(compare(store, q, D**-0.5, sinks=sinks))
        report.add("sinks", row)
    report["worst_sinks_rel_err"] = worst(report["sinks"], "kernel_rel_err")
    report.save()
    print(f"sinks: worst relative error {report['worst_sinks_rel_err']:.2e}")


def correctness(report, cases, page):
    mx.random.seed(0)
    for D, n_q, n_kv, kb, kg, vb, vg, T, B, dtype, first, held in cases:
        store = KVStore(Affine(kb, kg), Affine(vb, vg), first=first, page_size=page)
        keys = mx.random.normal((B, n_kv, T, D)) + 2 * mx.random.normal((1, n_kv, 1, D))
        values = mx.random.normal((B, n_kv, T, D))
        fill(store, keys.astype(dtype), values.astype(dtype), decode=held)
        noisy_tail(store)
        q = mx.random.normal((B, n_q, 1, D)).astype(dtype)
        row = {
            "D": D,
            "n_q_heads": n_q,
            "n_kv_heads": n_kv,
            "bits": [kb, vb],
            "group_size": [kg, vg],
            "tokens": T,
            "batch": B,
            "dtype": str(dtype),
            "first": first,
            "held": store.spans.n_held,
        }
        row.update(compare(store, q, D**-0.5))
        report.add("correctness", row)
    rows = report["correctness"]
    report["worst_rel_err"] = worst(rows, "kernel_rel_err")
    report["worst_ops_rel_err"] = worst(rows, "ops_rel_err")
    report.save()
    print(f"worst relative error against float32: {report['worst_rel_err']:.2e}")


def speed(report, contexts, page, bandwidth):
    B, n_q, n_kv, D = 1, 32, 8, 128
    for T in contexts:
        q = mx.random.normal((B, n_q, 1, D)).astype(mx.float16)
        k = mx.random.normal((B, n_kv, T, D)).astype(mx.float16)
        v = mx.random.normal((B, n_kv, T, D)).astype(mx.float16)
        mx.eval(q, k, v)
        row = {"tokens": T}
        row["fp16_sdpa_ms"] = ms_per_call(
            partial(mx.fast.scaled_dot_product_attention, q, k, v, scale=D**-0.5)
        )
        for kb, vb in ((8, 4), (4, 4), (8, 8)):
            store = fill(KVStore(Affine(kb), Affine(vb), page_size=page), k, v)
            row[f"kernel_{kb},{vb}_ms"] = ms_per_call(
                partial(
                    store.scaled_dot_product_attention, q, None, None, D**-0.5, None
                )
            )
            kv_bytes = sum(
                x.nbytes for p in store.key_pages + store.value_pages for x in p
            )
            row[f"floor_{kb},{vb}_ms"] = round(kv_bytes / bandwidth * 1e3, 4)
        report.add("speed", row)


def qmm_check(report, shapes):
    """MLX's quantized_matmul against a dequantized matmul."""
    mx.random.seed(1)
    for D, n_kv, rows in shapes:
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
                report.add(
                    "qmm",
                    {
                        "D": D,
                        "n_kv_heads": n_kv,
                        "rows": rows,
                        "bits": bits,
                        "group_size": group_size,
                        "transpose": transpose,
                        "rel_err": l2_error(y, ref),
                    },
                )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="decode-kernel.json")
    parser.add_argument("--parts", default="correctness,sinks,speed,qmm")
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=4.8e12,
        help="memory bytes/s for the floor (H200: 4.8e12; H100 SXM: 3.35e12)",
    )
    add_dry_run(parser)
    args = parser.parse_args()
    report = Report(args.out, start(args))
    if args.dry_run:
        cases, sink_cases, page, contexts = DRY_CASES, DRY_SINK_CASES, 64, [256]
        shapes = ((64, 2, 3),)
    else:
        cases, sink_cases, page, contexts = (
            CASES,
            SINK_CASES,
            PAGE,
            [4096, 32768, 131072],
        )
        shapes = ((64, 3, 3), (64, 3, 512), (128, 8, 4))
    parts = {
        "correctness": partial(correctness, cases=cases, page=page),
        "sinks": partial(sinks_correctness, cases=sink_cases, page=page),
        "speed": partial(speed, contexts=contexts, page=page, bandwidth=args.bandwidth),
        "qmm": partial(qmm_check, shapes=shapes),
    }
    for name in args.parts.split(","):
        if name not in parts:
            parser.error(f"unknown part {name!r}: choose from {', '.join(parts)}")
        parts[name](report)


if __name__ == "__main__":
    main()
