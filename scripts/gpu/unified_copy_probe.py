"""How fast the CPU writes into MLX arrays through numpy views (GPU machine).

A disk restore copies each block's slices into one MLX array per part through
numpy views of the arrays' memory (``omlx_cache.blocks.Plan``). On CUDA that
memory is unified (``cudaMallocManaged``). This times the copy of a 32K-token
8B-shape 4-bit prefix's worth of blocks (192 parts, 128 blocks of 256 tokens)
into arrays made in several ways, single-threaded and on 16 threads, twice
each (the second pass writes pages the first already touched):

- ``numpy``: plain numpy arrays (the floor);
- ``cpu_zeros``: ``mx.zeros`` on CPU streams (the restore's CPU path);
- ``gpu_zeros``: ``mx.zeros`` on the GPU, written where they are.

    python3 scripts/gpu/unified_copy_probe.py --out $OUT/unified-copy.json
"""

import argparse
import concurrent.futures
import json
import time

import mlx.core as mx
import numpy as np

LENGTH, BLOCK, HEADS = 32768, 256, 8
KINDS = ("numpy", "cpu_zeros", "gpu_zeros")
PARTS = [(16, np.uint32)] * 64 + [
    (2, np.float16)
] * 128  # per layer: packed, scales, biases


def make(kind):
    shapes = [((1, HEADS, LENGTH, width), dtype) for width, dtype in PARTS]
    if kind == "numpy":
        return [np.zeros(s, d) for s, d in shapes]
    mx_dtype = {np.uint32: mx.uint32, np.float16: mx.float16}
    if kind == "cpu_zeros":
        streams = [mx.new_stream(mx.cpu) for _ in range(16)]
        arrays = [
            mx.zeros(s, mx_dtype[d], stream=streams[i % 16])
            for i, (s, d) in enumerate(shapes)
        ]
    else:
        arrays = [mx.zeros(s, mx_dtype[d]) for s, d in shapes]
    mx.eval(arrays)
    return [np.asarray(x) for x in arrays], arrays


def copy_block(views, sources, b):
    start = b * BLOCK
    for view, x in zip(views, sources):
        view[..., start : start + BLOCK, :] = x


def timed(views, sources, threads):
    start = time.perf_counter()
    if threads == 1:
        for b in range(LENGTH // BLOCK):
            copy_block(views, sources, b)
    else:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(
                pool.map(
                    lambda b: copy_block(views, sources, b), range(LENGTH // BLOCK)
                )
            )
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    sources = [np.ones((1, HEADS, BLOCK, w), d) for w, d in PARTS]
    total = sum(x.nbytes for x in sources) * (LENGTH // BLOCK)
    rows = []
    for kind in KINDS:
        for threads in (1, 16):
            start = time.perf_counter()
            made = make(kind)
            views = made if kind == "numpy" else made[0]
            allocate = time.perf_counter() - start
            first = timed(views, sources, threads)
            second = timed(views, sources, threads)
            row = {
                "kind": kind,
                "threads": threads,
                "allocate_s": allocate,
                "first_s": first,
                "second_s": second,
                "first_gb_s": total / first / 1e9,
            }
            rows.append(row)
            print(
                f"{kind:18s} threads {threads:2d}: allocate {allocate:.3f} s, "
                f"copy {first:.3f} s ({total / first / 1e9:.2f} GB/s), again {second:.3f} s",
                flush=True,
            )
            del made, views
            mx.clear_cache()
    with open(opts.out, "w") as f:
        json.dump({"bytes": total, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
