"""One decode layer's attention kernels at an 8B shape, for Nsight Compute.

Fills an affine 4-bit and a codebook-3 cache with ``--context`` random keys
and values (one page each, 32 q / 8 kv heads, head dim 128, float16) and runs
a decode step (a token in, attention) of each ``--calls`` times, so that ``ncu`` can take
the decode and combine kernels of both:

    ncu --kernel-name regex:sdpa_decode --launch-skip 4 --launch-count 4 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 scripts/gpu/decode_kernel_ncu.py --context 131072

``--span N`` sets the keys per block of this process's decode launches (both
schemes; the sweep of what ``qd._decode_span`` picks), ``--schemes`` which
caches run.
"""

import argparse

import mlx.core as mx
from mlx_lm.models import quantized_decode as qd
from mlx_lm.models.cache import QuantizedKVCache

from omlx_cache.codebook import CodebookKVCache

N_Q, N_KV, D = 32, 8, 128


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--span", type=int, help="keys per block (a power of 2)")
    parser.add_argument(
        "--schemes", nargs="+", default=["4", "codebook-3"], choices=["4", "codebook-3"]
    )
    opts = parser.parse_args()
    if opts.span:
        qd._decode_span = lambda length, n_rows: opts.span
    affine = QuantizedKVCache(group_size=64, bits=4)
    affine.reserve = opts.context + 64
    codebook = CodebookKVCache(3, page_size=opts.context + 64)
    caches = [{"4": affine, "codebook-3": codebook}[scheme] for scheme in opts.schemes]
    chunk = mx.random.normal((1, N_KV, 4096, D)).astype(mx.float16)
    for cache in caches:
        for _ in range(opts.context // 4096):
            cache.update_and_fetch(chunk, chunk)
            mx.eval(cache.state)
    query = mx.random.normal((1, N_Q, 1, D)).astype(mx.float16)
    token = mx.random.normal((1, N_KV, 1, D)).astype(mx.float16)
    for cache in caches:
        for _ in range(opts.calls):
            kv = cache.update_and_fetch(token, token)
            out = cache.scaled_dot_product_attention(
                mx.array(query), *kv, scale=D**-0.5, mask=None
            )
            mx.eval(out)
    print("done", affine.offset, codebook.offset)


if __name__ == "__main__":
    main()
