"""The CUDA prefill's page decoding (``codebook_kernel.dequantize``) against
MLX ops (``Codebook.decode``, rotated back), on a model's own pages.

    python3 scripts/gpu/dequant_check.py --model models/gemma-3-270m --dtype bfloat16 \\
        --out $OUT/dequant-check.json
    MLX_ENABLE_TF32=0 python3 scripts/gpu/dequant_check.py --model ... --precision-only

First, on random data, the relative error against float64 of a float32
matmul, of ``kv_rotate``, of both decodings and of float32 SDPA at heads of
256: on CUDA MLX multiplies float32 matrices in TF32 unless
``MLX_ENABLE_TF32=0``. Then a passkey prompt (``omlx_cache.eval``'s) goes
through the model in the server's 2,048-token steps with the kernels on, and
every call of the prefill's page decoding is decoded by MLX ops too: the
largest difference per call, relative to the page's largest element, and the
vectors that differ by more than 1e-3 of it. Session 23 ran it to see whether
the kernel was what moved Gemma's passkeys (docs/quality-levers.md).
"""

import argparse
import json

import mlx.core as mx
import numpy as np

from omlx_cache import codebook_kernel, schemes
from omlx_cache import eval as kv_eval
from omlx_cache.codebook import Codebook, rotate


def float32_precision() -> dict:
    """Relative errors against float64 (numpy) of a float32 matmul, of
    ``kv_rotate``'s Hadamard rotation (a matmul), of the dequantize kernel's
    rotation (its fast transform) and of float32 SDPA at heads of 256."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 512, 256))
    x = rng.standard_normal((1, 1, 512, 256))

    def error(got, want):
        got = np.array(got, dtype=np.float64)
        return float(np.linalg.norm(got - want) / np.linalg.norm(want))

    def f32(v):
        return mx.array(v.astype(np.float32))

    report = {"matmul": error(f32(a) @ f32(b).T, a @ b.T)}
    rotated = np.array(rotate(f32(x), "hadamard"), dtype=np.float64)
    back = rotate(mx.array(rotated.astype(np.float32)), "hadamard", inverse=True)
    report["kv_rotate_back"] = error(back, x)
    codec = Codebook(5)
    page = codec.encode(f32(x))
    mx.eval(page)
    with mx.stream(mx.cpu):  # float32 matmuls on the CPU: no TF32
        exact = np.array(
            codebook_kernel.dequantize_by_ops(page, codec, mx.float32), dtype=np.float64
        )
    if codebook_kernel._cuda_available():
        report["dequantize_kernel"] = error(
            codebook_kernel.dequantize(page, codec, mx.float32), exact
        )
    report["dequantize_ops"] = error(
        codebook_kernel.dequantize_by_ops(page, codec, mx.float32), exact
    )
    q, k, v = (rng.standard_normal((1, 4, 256, 256)) for _ in range(3))
    scores = q @ k.swapaxes(-1, -2) / 16
    w = np.exp(scores - scores.max(-1, keepdims=True))
    want = (w / w.sum(-1, keepdims=True)) @ v
    got = mx.fast.scaled_dot_product_attention(f32(q), f32(k), f32(v), scale=1 / 16)
    report["sdpa_f32_d256"] = error(got, want)
    print(json.dumps(report), flush=True)
    return report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv", default="codebook-5k-5v+center+qscale+exact8")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--out")
    parser.add_argument("--precision-only", action="store_true")
    args = parser.parse_args()
    precision = float32_precision()
    if args.precision_only:
        return
    model, tokenizer = kv_eval.load_model(args.model)
    model.set_dtype(kv_eval.DTYPES[args.dtype])
    prompt = kv_eval.passkey_prompt(
        tokenizer, args.tokens, 0.5, "68755", tokenizer.bos_token_id
    )
    calls = []
    by_kernel = codebook_kernel._dequantize_pages

    def compared(pages, codec, length, dtype):
        shapes = [p[0].shape[2] for p in pages]
        got = by_kernel(pages, codec, length, dtype)
        mx.eval(got)
        with codebook_kernel.decoding_by_ops():
            want = by_kernel(pages, codec, length, dtype)
        mx.eval(want)
        a, b = (np.array(x.astype(mx.float32)) for x in (got, want))
        diff = np.abs(a - b).max(axis=-1)  # per vector
        bad = np.argwhere(diff > 1e-3 * (np.abs(b).max() + 1e-30))
        calls.append(
            {
                "bits": codec.bits,
                "pages": shapes,
                "length": length,
                "max_diff": float(diff.max()),
                "scale": float(np.abs(b).max()),
                "bad_vectors": len(bad),
                "first_bad": bad[:4].tolist(),
                "nonfinite": int((~np.isfinite(a)).sum()),
            }
        )
        print(json.dumps(calls[-1]), flush=True)
        return got

    codebook_kernel._dequantize_pages = compared
    cache = schemes.get_scheme(args.kv).make_cache(model)
    kv_eval.prefill(model, prompt.tokens, cache, args.chunk)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"precision": precision, "calls": calls}, f, indent=1)


if __name__ == "__main__":
    main()
