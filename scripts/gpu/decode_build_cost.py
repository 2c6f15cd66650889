"""Host time of one decode layer: codebook-3 against affine 4-bit.

Per layer of a Llama-3-8B shape (32 q / 8 kv heads, head dim 128), caches of
``--context`` tokens (codebook-3 also with its held tokens written as they
come, ``/slices``): the median microseconds Python and MLX spend building a
decode token's cache update and attention (the kernels' launches included as
graph nodes, not run), and ``mx.async_eval``'s own time on that graph (the
host encoding its kernels), each step finished outside the timing. The
schemes take turns step by step (the host's speed drifts by a factor of two
within a run), and each scheme's steps are also compared with affine 4-bit's
of the same turn (the median of the paired ratios of build plus launch). A
decode step that waits on the host pays both once per layer. ``--profile``
adds cProfile's functions with the most time of their own.

    python3 scripts/gpu/decode_build_cost.py --context 32768
"""

import argparse
import cProfile
import pstats
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from omlx_cache.codebook import CodebookKVCache

N_Q, N_KV, D = 32, 8, 128


def filled_caches(context):
    keys = mx.random.normal((1, N_KV, context, D)).astype(mx.float16)
    affine = QuantizedKVCache(group_size=64, bits=4)
    affine.reserve = context + 4096
    codebook, slices = (CodebookKVCache(3, page_size=context + 4096) for _ in range(2))
    slices.kernel_writes_held = False
    for cache in (affine, codebook, slices):
        cache.update_and_fetch(keys, keys)
        mx.eval(cache.state)
    return {"4": affine, "codebook-3": codebook, "codebook-3/slices": slices}


def decode_layer(cache, query, token):
    def build():
        keys, values = cache.update_and_fetch(token, token)
        return cache.scaled_dot_product_attention(
            query, keys, values, scale=D**-0.5, mask=None
        )

    return build


def timings(builds, steps):
    """Per scheme, the seconds of building each step and of launching it,
    the schemes taking turns."""
    times = {name: ([], []) for name in builds}
    for _ in range(steps):
        for name, build in builds.items():
            start = time.perf_counter()
            out = build()
            built = time.perf_counter()
            mx.async_eval(out)
            times[name][0].append(built - start)
            times[name][1].append(time.perf_counter() - built)
            mx.eval(out)
    return times


def report(times):
    affine = [b + la for b, la in zip(*times["4"])]
    for name, (builds, launches) in times.items():
        paired = [(b + la) / a for b, la, a in zip(builds, launches, affine)]
        print(
            f"{name:17s} build {1e6 * statistics.median(builds):6.1f} us  "
            f"launch {1e6 * statistics.median(launches):6.1f} us  "
            f"vs 4 {statistics.median(paired):5.2f}x",
            flush=True,
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    opts = parser.parse_args()
    query = mx.random.normal((1, N_Q, 1, D)).astype(mx.float16)
    token = mx.random.normal((1, N_KV, 1, D)).astype(mx.float16)
    for _ in range(opts.repeats):
        caches = filled_caches(opts.context)
        builds = {name: decode_layer(c, query, token) for name, c in caches.items()}
        report(timings(builds, opts.steps))
    if opts.profile:
        for name, cache in filled_caches(opts.context).items():
            build = decode_layer(cache, query, token)
            profiler = cProfile.Profile()
            for _ in range(opts.steps):
                profiler.enable()
                out = build()
                profiler.disable()
                mx.eval(out)
            print(f"== {name}")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
