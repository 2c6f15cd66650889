"""Where a ``generate_step`` decode step's time goes, per KV scheme (GPU machine).

``generate_step`` builds step n+1's graph in Python, hands it to MLX
(``mx.async_eval``: MLX evaluates the graph's primitives on the host, records
their kernels into CUDA graphs and launches them), then waits for step n's
token (``y.item()``). This script wraps ``mx.async_eval`` to time the three
phases of each step, with the schemes' steps interleaved as in
``generate_interleaved.py`` (same scheme names, the first two steps of a turn
not counted): *build* (Python, from the last token's return to
``async_eval``), *submit* (inside ``async_eval``) and *wait* (from there to
the token's return: the GPU finishing the step before). A scheme whose host
phases are shorter but whose steps are longer is waiting on the GPU.

    python3 scripts/gpu/step_phases.py --context 32768 --schemes 4 codebook-3 \\
        --out $OUT/step-phases.json
"""

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import time

import mlx.core as mx
from generate_interleaved import (
    SKIPPED,
    checked_model,
    decode_span,
    split_name,
    start,
    turn_arguments,
    write_report,
)

PHASES = ("build", "submit", "wait", "step")


class Collections:
    """Time Python's garbage collector takes, summed (``gc.callbacks``)."""

    def __init__(self):
        self.seconds = 0.0
        self.count = 0
        self._began = None
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self.count += 1
            self._began = None


class Timed:
    """``mx.async_eval`` with its start and end times kept."""

    def __init__(self, async_eval):
        self.async_eval = async_eval
        self.calls = []

    def __call__(self, *args, **kwargs):
        begin = time.perf_counter()
        out = self.async_eval(*args, **kwargs)
        self.calls.append((begin, time.perf_counter()))
        return out


def turn(steps, n, timed, name, profile=None):
    """Each of ``n`` decode steps' phases in ms: the async_eval made during a
    step is the next step's, its wait the current token's (under ``profile``,
    a ``cProfile.Profile``, if given)."""
    last = time.perf_counter()
    with decode_span(split_name(name)[2]):
        if profile is None:
            return _turn(steps, n, timed, last)
        profile.enable()
        try:
            return _turn(steps, n, timed, last)
        finally:
            profile.disable()


def _turn(steps, n, timed, last):
    rows = []
    for _ in range(n):
        timed.calls.clear()
        next(steps)
        done = time.perf_counter()
        if len(timed.calls) != 1:
            continue
        begin, end = timed.calls[0]
        rows.append(
            {
                "build": 1e3 * (begin - last),
                "submit": 1e3 * (end - begin),
                "wait": 1e3 * (done - end),
                "step": 1e3 * (done - last),
            }
        )
        last = done
    return rows


def top_functions(profile, n_steps, count=40):
    """The ``count`` functions with the most own time, in µs a step."""
    stats = pstats.Stats(profile).stats
    rows = []
    for (path, line, function), (_, calls, own, total, _) in stats.items():
        where = f"{os.path.basename(path)}:{line}({function})"
        rows.append((own, total, calls, where))
    rows.sort(reverse=True)
    return [
        {
            "function": where,
            "own_us_per_step": 1e6 * own / n_steps,
            "total_us_per_step": 1e6 * total / n_steps,
            "calls_per_step": calls / n_steps,
        }
        for own, total, calls, where in rows[:count]
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    turn_arguments(parser, blocks=24)
    parser.add_argument(
        "--python-profile",
        action="store_true",
        help="cProfile each scheme's turns: its functions by own time in the JSON",
    )
    opts = parser.parse_args()
    model = checked_model(parser, opts)
    vocab = model.args.vocab_size
    timed = Timed(mx.async_eval)
    mx.async_eval = timed
    tokens = (opts.blocks + 1) * opts.block_steps + 2
    generators = []
    for name in opts.schemes:
        steps, seconds = start(model, name, opts.context, tokens, vocab)
        turn(steps, opts.block_steps, timed, name)  # kernels compiled, buffers warm
        generators.append(steps)
        print(f"{name:<14} prefilled {opts.context} tokens in {seconds:.2f} s")
    phases = {name: [] for name in opts.schemes}
    collections = Collections()
    collected = {name: [0.0, 0] for name in opts.schemes}
    profiles = {name: cProfile.Profile() for name in opts.schemes}
    for _ in range(opts.blocks):
        for name, steps in zip(opts.schemes, generators):
            profile = profiles[name] if opts.python_profile else None
            seconds, count = collections.seconds, collections.count
            phases[name] += turn(steps, opts.block_steps, timed, name, profile)[
                SKIPPED:
            ]
            collected[name][0] += collections.seconds - seconds
            collected[name][1] += collections.count - count
    rows = []
    for name in dict.fromkeys(opts.schemes):
        medians = {p: statistics.median(r[p] for r in phases[name]) for p in PHASES}
        means = {p: statistics.fmean(r[p] for r in phases[name]) for p in PHASES}
        n_steps = opts.blocks * opts.block_steps * opts.schemes.count(name)
        row = {
            "scheme": name,
            "median_ms": medians,
            "mean_ms": means,
            "gc_ms_per_step": 1e3 * collected[name][0] / n_steps,
            "gc_collections_per_step": collected[name][1] / n_steps,
        }
        if opts.python_profile:
            row["python_profile"] = top_functions(profiles[name], n_steps)
        rows.append(row)
        print(
            f"{name:<14} "
            + ", ".join(f"{p} {medians[p]:.3f} ({means[p]:.3f})" for p in PHASES)
            + f" ms, median (mean); gc {row['gc_ms_per_step']:.3f} ms a step",
            flush=True,
        )
    write_report(opts, rows, skipped_per_turn=SKIPPED)


if __name__ == "__main__":
    main()
