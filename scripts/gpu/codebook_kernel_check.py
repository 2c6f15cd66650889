"""Correctness and speed of ``omlx_cache.codebook_kernel`` (GPU machine).

Encode and dequantize kernels against the MLX-ops codec; decode attention
(one query, single and batched with left padding, several pages) and prefill
against float32 attention over the cache's decoded keys and values; then the
decode kernel's time per layer at an 8B shape against patch 0011's affine
kernel.

    python3 scripts/gpu/codebook_kernel_check.py --out $OUT/codebook-kernel.json
"""

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.models import quantized_decode
from mlx_lm.models.cache import QuantizedKVCache

from omlx_cache import codebook_kernel
from omlx_cache.codebook import Codebook, CodebookKVCache, rotate


def reference(queries, cache, scale, mask=None):
    """float32 attention over the cache's decoded keys and values, its held
    decode tokens as they came (the decode kernel reads them unquantized;
    run on 2026-11-23, the check compared with them encoded)."""
    n = cache.n_held
    if n:
        held = [
            x[:, :, :n].astype(mx.float32) for x in (cache.held_keys, cache.held_values)
        ]
        for i, mean in enumerate((cache.key_mean, cache.value_mean)):
            if mean is not None:
                held[i] = held[i] + mean
    keys, values = cache.dequantize(mx.float32)  # (encodes the held tokens)
    if n:
        keys = mx.concatenate([keys[:, :, :-n], held[0]], axis=2)
        values = mx.concatenate([values[:, :, :-n], held[1]], axis=2)
    B, n_q, L, D = queries.shape
    n_kv = keys.shape[1]
    q = queries.astype(mx.float32).reshape(B, n_kv, n_q // n_kv * L, D)
    scores = (q * scale) @ keys.swapaxes(-1, -2)
    scores = scores.reshape(B, n_kv, n_q // n_kv, L, -1)
    if isinstance(mask, str):
        n = keys.shape[2]
        causal = mx.arange(n)[None] <= (mx.arange(L)[:, None] + n - L)
        scores = mx.where(causal, scores, -float("inf"))
    elif mask is not None:
        m = mask[:, :, None] if mask.ndim == 4 else mask
        scores = mx.where(m, scores, -float("inf"))
    out = mx.softmax(scores, axis=-1) @ values[:, :, None]
    return out.reshape(B, n_q, L, D)


def rel(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


def check_codec(rows):
    for bits in (3, 4):
        for D in (64, 128, 256):
            for rotation in ("hadamard", "none"):
                codec = Codebook(bits, rotation)
                x = mx.random.normal((2, 8, 37, D)).astype(mx.float16) * 3
                packed, norms = codec.encode(x)
                with codebook_kernel.disabled():
                    ref_packed, ref_norms = codec.encode(x)
                same = (packed == ref_packed).mean().item()
                norm_err = rel(norms, ref_norms)
                page = (ref_packed, ref_norms)
                out = codebook_kernel.dequantize(page, codec, mx.float32)
                with codebook_kernel.disabled():
                    ref = rotate(codec.decode(page, mx.float32), rotation, True)
                rows.append(
                    {
                        "check": "codec",
                        "bits": bits,
                        "D": D,
                        "rotation": rotation,
                        "packed_words_equal": same,
                        "norm_rel_err": norm_err,
                        "dequantize_rel_err": rel(out, ref),
                    }
                )
                print(rows[-1], flush=True)


def filled(keys_bits, values_bits, B, n_kv, n, D, page_size, center="", held=0):
    """A cache of ``n`` random tokens, the last ``held`` of them written one
    at a time (held unquantized for the decode kernel, where it runs)."""
    cache = CodebookKVCache(keys_bits, values_bits, page_size=page_size, center=center)
    k = mx.random.normal((B, n_kv, n, D)).astype(mx.float16)
    v = mx.random.normal((B, n_kv, n, D)).astype(mx.float16)
    # an outlier channel, as real keys have
    k = k + 4 * (mx.arange(D) == 3).astype(mx.float16)
    step = 1000
    for s in range(0, n - held, step):
        stop = min(s + step, n - held)
        cache.update_and_fetch(k[:, :, s:stop], v[:, :, s:stop])
    for t in range(n - held, n):
        cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
    mx.eval(cache.key_pages, cache.value_pages)
    return cache


def check_attention(rows):
    cases = [
        # keys bits, values bits, B, n_q, n_kv, D, tokens, page size
        (3, 3, 1, 32, 8, 128, 4097, 4096),
        (4, 4, 1, 32, 8, 128, 3000, 4096),
        (4, 3, 1, 32, 8, 128, 2500, 1024),
        (3, 4, 1, 32, 8, 128, 2500, 1024),
        (3, 3, 1, 8, 8, 64, 777, 256),
        (4, 4, 1, 16, 2, 64, 1500, 4096),
        (3, 3, 1, 16, 4, 256, 2049, 4096),
        (4, 3, 1, 9, 3, 64, 300, 4096),
        (3, 3, 1, 32, 8, 128, 9000, 256),
    ]
    scale = 0.088
    for kb, vb, B, n_q, n_kv, D, n, page in cases:
        for center, L, mask, held in (
            ("", 1, None, 0),
            ("", 33, "causal", 0),
            ("", 1, None, 5),
            ("kv", 1, None, 37),
            ("kv", 33, "causal", 0),
        ):
            cache = filled(kb, vb, B, n_kv, n, D, page, center, held)
            n_held = cache.n_held
            q = mx.random.normal((B, n_q, L, D)).astype(mx.float16)
            out = cache.scaled_dot_product_attention(
                q, cache.key_pages, cache.value_pages, scale, mask
            )
            # (before the ops path, which encodes the held tokens first)
            ref = reference(q, cache, scale, mask)
            ops = None
            if L == 1:  # (the ops path's prefill is slow over many pages)
                with codebook_kernel.disabled():
                    ops = cache.scaled_dot_product_attention(
                        q, cache.key_pages, cache.value_pages, scale, mask
                    )
            rows.append(
                {
                    "check": "attention",
                    "bits": (kb, vb),
                    "B": B,
                    "heads": (n_q, n_kv),
                    "D": D,
                    "tokens": n,
                    "page": page,
                    "center": center,
                    "L": L,
                    "held": n_held,
                    "kernel_rel_err": rel(out, ref),
                    "ops_rel_err": None if ops is None else rel(ops, ref),
                }
            )
            print(rows[-1], flush=True)
    # batched decode with left padding (a boolean and an additive mask)
    for kb, vb in ((3, 3), (4, 4), (3, 4)):
        B, n_q, n_kv, D, n = 3, 32, 8, 128, 1500
        cache = filled(kb, vb, B, n_kv, n, D, 4096)
        padding = mx.array([0, 100, 777])
        valid = mx.arange(n)[None] >= padding[:, None]
        mask = valid[:, None, None, :]
        q = mx.random.normal((B, n_q, 1, D)).astype(mx.float16)
        ref = reference(q, cache, 0.088, mask)
        for kind, m in (("bool", mask), ("additive", mx.where(mask, 0.0, -1e9))):
            m = m.astype(mx.float16) if kind == "additive" else m
            out = cache.scaled_dot_product_attention(
                q, cache.key_pages, cache.value_pages, 0.088, m
            )
            rows.append(
                {
                    "check": "batched",
                    "bits": (kb, vb),
                    "mask": kind,
                    "kernel_rel_err": rel(out, ref),
                }
            )
            print(rows[-1], flush=True)


def timed(fn, n=30):
    for _ in range(3):
        mx.eval(fn())
    start = time.perf_counter()
    for _ in range(n):
        mx.eval(fn())
    return (time.perf_counter() - start) / n * 1e3


def speed(rows, contexts):
    B, n_q, n_kv, D = 1, 32, 8, 128
    for n in contexts:
        k = mx.random.normal((B, n_kv, n, D)).astype(mx.float16)
        v = mx.random.normal((B, n_kv, n, D)).astype(mx.float16)
        q = mx.random.normal((B, n_q, 1, D)).astype(mx.float16)
        affine = QuantizedKVCache(group_size=64, bits=4, reserve=n)
        affine.update_and_fetch(k, v)
        mx.eval(affine.key_pages, affine.value_pages)
        length = affine.offset

        def affine_call(q=q, affine=affine, length=length):
            return quantized_decode.quantized_decode_attention(
                q,
                affine.key_pages,
                affine.value_pages,
                0.088,
                length,
                64,
                4,
                64,
                4,
            )

        row = {"check": "speed", "context": n, "affine_4_ms": timed(affine_call)}
        for kb, vb in ((3, 3), (4, 4)):
            cache = CodebookKVCache(kb, vb, page_size=n)
            cache.update_and_fetch(k, v)
            mx.eval(cache.key_pages, cache.value_pages)

            def call(cache=cache, q=q):
                return cache.scaled_dot_product_attention(
                    q, cache.key_pages, cache.value_pages, 0.088, None
                )

            row[f"codebook_{kb}_{vb}_ms"] = timed(call)

            def encode(cache=cache, k=k):
                return cache.key_codec.encode(k[:, :, :1])

            row[f"encode_{kb}_ms"] = timed(encode)
        rows.append(row)
        print(row, flush=True)


class Rows(list):
    """Rows written to ``path`` as they come (a run cut short keeps them)."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def append(self, row):
        super().append(row)
        with open(self.path, "w") as f:
            json.dump({"rows": self}, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    mx.random.seed(0)
    rows = Rows(opts.out)
    start = time.perf_counter()
    check_codec(rows)
    check_attention(rows)
    speed(rows, [int(c) for c in opts.contexts.split(",") if c])
    worst = {
        "decode_and_prefill_kernel_rel_err": max(
            r["kernel_rel_err"] for r in rows if r["check"] in ("attention", "batched")
        ),
        "ops_rel_err": max(
            r["ops_rel_err"] for r in rows if r.get("ops_rel_err") is not None
        ),
        "dequantize_rel_err": max(
            r["dequantize_rel_err"] for r in rows if r["check"] == "codec"
        ),
        "packed_words_equal_min": min(
            r["packed_words_equal"] for r in rows if r["check"] == "codec"
        ),
        "norm_rel_err": max(r["norm_rel_err"] for r in rows if r["check"] == "codec"),
    }
    print("worst", worst, f"({time.perf_counter() - start:.1f} s)", flush=True)
    report = {"device": str(mx.default_device()), "worst": worst, "rows": rows}
    report["device_info"] = {
        k: v for k, v in mx.device_info().items() if isinstance(v, (int, str))
    }
    with open(opts.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
