"""Every kernel of whole decode steps of one scheme, for Nsight Compute.

A bench preset's model (Llama-3-8B shape by default, random 4-bit weights),
its caches filled with ``--context`` random keys and values (one page, as
``codebook_step_profile.py``), ``--warmup`` decode steps run unprofiled (the
kernels compile, held tokens fill), then ``--steps`` decode steps of the
model, each evaluated, between ``cuProfilerStart`` and ``cuProfilerStop``:
with ``ncu --profile-from-start off`` only those steps' kernels are
measured. Run once per scheme and sum a report's durations
(``ncu_summary.py``) for the device time of a step, launches excluded:

    for s in 4 codebook-3; do
        ncu --profile-from-start off --section SpeedOfLight \\
            python3 scripts/gpu/step_kernels_ncu.py --scheme $s --context 131072 \\
            > $OUT/step-$s.txt
    done
    python3 scripts/gpu/ncu_summary.py 4=$OUT/step-4.txt \\
        codebook-3=$OUT/step-codebook-3.txt --out $OUT/step-kernels.json
"""

import argparse
import ctypes
import os
import sys

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from codebook_step_profile import fill, make_caches

from omlx_cache import bench


def profiler():
    """The CUDA driver's profiler switch (start, stop); no-ops without the
    driver (to check the script on the CPU)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        print("no CUDA driver: nothing to profile")
        return (lambda: None), (lambda: None)
    return driver.cuProfilerStart, driver.cuProfilerStop


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(bench.PRESETS))
    parser.add_argument("--scheme", default="codebook-3")
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--steps", type=int, default=1)
    opts = parser.parse_args()
    preset = bench.PRESETS[opts.preset]
    dtype = getattr(mx, preset.get("dtype", "float16"))
    model = bench.build_model(preset, dtype)
    caches = make_caches(model, opts.scheme, opts.context + opts.warmup + 64)
    fill(caches, model.args, opts.context, dtype)
    token = mx.array([[1]])
    for _ in range(opts.warmup):
        mx.eval(model(token, cache=caches))
    start, stop = profiler()
    start()
    for _ in range(opts.steps):
        mx.eval(model(token, cache=caches))
    stop()
    held = getattr(caches[0], "n_held", getattr(caches[0], "_n_held", 0))
    print(f"{opts.scheme}: {opts.steps} step(s) profiled, {held} token(s) held")


if __name__ == "__main__":
    main()
