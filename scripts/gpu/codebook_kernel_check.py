"""Correctness and speed of the codebook kernels (``omlx_cache.kernels.codebook``)
through ``omlx_cache.kv`` stores (GPU machine).

The encode and dequantize kernels against the MLX-ops codec; attention of
``KVStore``s of ``Codebook`` codecs (decode with the tokens the decode kernel
holds, prefill, centered, first tokens kept; several pages) and of a
left-padded ``BatchKVStore`` through the kernels and through
``omlx_cache.kv.kernels.disabled()`` (the MLX-ops loop), each against float32
attention over what the store holds; then the decode kernel's time per layer
at an 8B shape against the affine decode kernel's (a ``KVStore`` of
``Affine(4)``). Worst errors and the rows go to --out as JSON.

    python3 scripts/gpu/codebook_kernel_check.py --out $OUT/codebook-kernel.json

``--dry-run`` runs the same code on the CPU at small shapes, through the
MLX-ops loop (no kernel applies there): it checks the script, not the kernels.
"""

import argparse
import time
from functools import partial

import mlx.core as mx
from kv_check import (
    Report,
    add_dry_run,
    compare,
    fill,
    max_error,
    ms_per_call,
    noisy_tail,
    start,
    worst,
)

from omlx_cache.kernels import codebook as codebook_kernel
from omlx_cache.kv import Affine, BatchKVStore, Codebook, KVStore, kernels
from omlx_cache.kv.codebook import unpack


def check_codec(report, dims):
    for bits in (3, 4, 5):
        for D in dims:
            for rotation in ("hadamard", "none"):
                codec = Codebook(bits, rotation)
                x = mx.random.normal((2, 8, 37, D)).astype(mx.float16) * 3
                packed, norms = codec.encode(x)
                with kernels.disabled():
                    ref_packed, ref_norms = codec.encode(x)
                page = (ref_packed, ref_norms)
                ref = codebook_kernel.dequantize_by_ops(page, codec, mx.float32)
                row = {
                    "check": "codec",
                    "bits": bits,
                    "D": D,
                    "rotation": rotation,
                    "encode_kernel": codebook_kernel.encodes(x, codec),
                    "indices_equal": (unpack(packed, bits) == unpack(ref_packed, bits))
                    .mean()
                    .item(),
                    "norm_rel_err": max_error(norms, ref_norms),
                }
                if codebook_kernel._on_cuda("encode"):
                    out = codebook_kernel.dequantize(page, codec, mx.float32)
                    row["dequantize_rel_err"] = max_error(out, ref)
                report.add("codec", row)


def check_attention(report, cases, batched):
    scale = 0.088
    for kb, vb, n_q, n_kv, D, n, page in cases:
        for center, L, held, first in (
            ("", 1, 0, 0),
            ("", 33, 0, 0),
            ("", 1, 5, 0),
            # a transform needs first tokens: 2, the fewest
            ("kv", 1, 37, 2),
            ("kv", 33, 0, 2),
            ("k", 1, 9, 16),
            ("k", 33, 0, 16),
        ):
            store = KVStore(
                Codebook(kb), Codebook(vb), page_size=page, center=center, first=first
            )
            k = mx.random.normal((1, n_kv, n, D)).astype(mx.float16)
            v = mx.random.normal((1, n_kv, n, D)).astype(mx.float16)
            # an outlier channel, as real keys have
            k = k + 4 * (mx.arange(D) == 3).astype(mx.float16)
            fill(store, k, v, chunk=1000, decode=held)
            noisy_tail(store)
            q = mx.random.normal((1, n_q, L, D)).astype(mx.float16)
            row = {
                "check": "attention",
                "bits": [kb, vb],
                "heads": [n_q, n_kv],
                "D": D,
                "tokens": n,
                "page": page,
                "center": center,
                "first": first,
                "L": L,
                "held": store.spans.n_held,
            }
            row.update(compare(store, q, scale, "causal" if L > 1 else None))
            report.add("attention", row)
    # batched decode with left padding (a boolean and an additive mask)
    B, n_q, n_kv, D, n = batched
    for kb, vb in ((3, 3), (4, 4), (3, 4), (5, 4)):
        padding = [0, n // 15, n // 2][:B]
        store = BatchKVStore(padding, Codebook(kb), Codebook(vb), first=8)
        k = mx.random.normal((B, n_kv, n, D)).astype(mx.float16)
        fill(store, k, k * 0.5, decode=3)
        q = mx.random.normal((B, n_q, 1, D)).astype(mx.float16)
        # the mask of the next token, as the model makes it before writing
        mask = store.make_mask(1)
        token = mx.random.normal((B, n_kv, 1, D)).astype(mx.float16)
        store.update_and_fetch(token, token)
        for kind, m in (("bool", mask), ("additive", mx.where(mask, 0.0, -1e9))):
            m = m.astype(mx.float16) if kind == "additive" else m
            row = {"check": "batched", "bits": [kb, vb], "mask": kind}
            row.update(compare(store, q, 0.088, m))
            report.add("batched", row)


def speed(report, contexts):
    B, n_q, n_kv, D = 1, 32, 8, 128
    for n in contexts:
        k = mx.random.normal((B, n_kv, n, D)).astype(mx.float16)
        v = mx.random.normal((B, n_kv, n, D)).astype(mx.float16)
        q = mx.random.normal((B, n_q, 1, D)).astype(mx.float16)
        row = {"check": "speed", "context": n}
        for name, codecs in (
            ("affine_4", (Affine(4), Affine(4))),
            ("codebook_3_3", (Codebook(3), Codebook(3))),
            ("codebook_4_4", (Codebook(4), Codebook(4))),
        ):
            store = KVStore(*codecs, page_size=n)
            fill(store, k, v)

            call = partial(store.scaled_dot_product_attention, q, None, None, 0.088)
            row[f"{name}_ms"] = ms_per_call(partial(call, None))
            if name.startswith("codebook"):
                codec = codecs[0]
                encode = partial(codec.encode, k[:, :, :1])
                row[f"encode_{codec.bits}_ms"] = ms_per_call(encode)
        report.add("speed", row)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument("--out", required=True)
    add_dry_run(parser)
    opts = parser.parse_args()
    report = Report(opts.out, start(opts))
    mx.random.seed(0)
    began = time.perf_counter()
    if opts.dry_run:
        dims = (64,)
        cases = [(3, 4, 4, 2, 64, 100, 64), (5, 3, 6, 2, 64, 70, 32)]
        batched = (3, 4, 2, 64, 90)
        contexts = [256]
    else:
        dims = (64, 128, 256)
        cases = [
            # keys bits, values bits, n_q, n_kv, D, tokens, page size
            (3, 3, 32, 8, 128, 4097, 4096),
            (4, 4, 32, 8, 128, 3000, 4096),
            (4, 3, 32, 8, 128, 2500, 1024),
            (3, 4, 32, 8, 128, 2500, 1024),
            (5, 4, 32, 8, 128, 3000, 1024),
            (3, 3, 8, 8, 64, 777, 256),
            (4, 4, 16, 2, 64, 1500, 4096),
            (3, 3, 16, 4, 256, 2049, 4096),
            (5, 5, 16, 4, 256, 2500, 1024),
            (4, 3, 9, 3, 64, 300, 4096),
            (3, 3, 32, 8, 128, 9000, 256),
        ]
        batched = (3, 32, 8, 128, 1500)
        contexts = [int(c) for c in opts.contexts.split(",") if c]
    check_codec(report, dims)
    check_attention(report, cases, batched)
    speed(report, contexts)
    rows = report["attention"] + report["batched"]
    report["worst"] = {
        "kernel_rel_err": worst(rows, "kernel_rel_err"),
        "ops_rel_err": worst(rows, "ops_rel_err"),
        "kernel_vs_ops": worst(rows, "kernel_vs_ops"),
        "dequantize_rel_err": worst(report["codec"], "dequantize_rel_err"),
        "norm_rel_err": worst(report["codec"], "norm_rel_err"),
        "indices_equal_min": min(r["indices_equal"] for r in report["codec"]),
    }
    report.save()
    seconds = time.perf_counter() - began
    print("worst", report["worst"], f"({seconds:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
