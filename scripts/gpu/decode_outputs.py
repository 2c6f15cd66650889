"""Affine decode attention's outputs on fixed inputs, saved to compare two builds.

Quantized caches (8-bit keys in groups of 64, 4-bit values in groups of 32) of
float32, float16 and bfloat16 keys; 4/4, 6/2 and 32/8 query/KV heads; head dims
64 and 128; three decode steps each (held tokens on CUDA). Run it with each
build's mlx-lm first on ``PYTHONPATH``, then ``--compare`` the two files: a
change that should not change the kernel's code (patch 0023) gives identical
outputs.

    PYTHONPATH=OLD/mlx-lm python3 scripts/gpu/decode_outputs.py /tmp/old.npz
    PYTHONPATH=vendor/mlx-lm python3 scripts/gpu/decode_outputs.py /tmp/new.npz
    python3 scripts/gpu/decode_outputs.py --compare /tmp/old.npz /tmp/new.npz
"""

import argparse

import mlx.core as mx
import numpy as np


def outputs():
    from mlx_lm.models.base import scaled_dot_product_attention
    from mlx_lm.models.cache import QuantizedKVCache

    out = {}
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        for n_q, n_kv in ((4, 4), (6, 2), (32, 8)):
            for dim, length in ((64, 40), (128, 3000)):
                mx.random.seed(7)
                cache = QuantizedKVCache(group_size=(64, 32), bits=(8, 4))
                prompt = mx.random.normal((2, n_kv, length, dim)).astype(dtype)
                cache.update_and_fetch(prompt, prompt * 0.5)
                for step in range(3):
                    token = mx.random.normal((2, n_kv, 1, dim)).astype(dtype)
                    keys, values = cache.update_and_fetch(token, token)
                    q = mx.random.normal((2, n_q, 1, dim)).astype(dtype)
                    o = scaled_dot_product_attention(
                        q, keys, values, cache=cache, scale=dim**-0.5, mask=None
                    )
                    name = f"{dtype}-{n_q}-{n_kv}-{dim}-{step}"
                    out[name] = np.array(o.astype(mx.float32))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--compare", action="store_true")
    opts = parser.parse_args()
    if opts.compare:
        a, b = (np.load(f) for f in opts.files)
        same = sum(np.array_equal(a[k], b[k]) for k in a)
        worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
        print(
            f"{same} of {len(a.files)} outputs identical, largest difference {worst:g}"
        )
        return
    out = outputs()
    np.savez(opts.files[0], **out)
    print(f"{len(out)} outputs to {opts.files[0]}")


if __name__ == "__main__":
    main()
