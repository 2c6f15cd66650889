"""Decode speed of KV schemes through ``generate_step``, their steps interleaved.

On the lent GPU machine a decode step's time moves by a factor of two within
one generation (phases of tens of steps at 5 or at 10 ms), so schemes timed one
after another differ by the phase each met. Here every scheme gets its own
``generate_step`` over the same random prompt, all prefilled first and kept
alive; then the schemes take turns, ``--block-steps`` decode steps each, for
``--blocks`` rounds. The first two steps of a turn are not counted (the
pipelined loop's step in flight was made during another scheme's turn).
Each scheme's median step is reported with the median, over rounds, of its
turn's median against the first scheme's in the same round (and a 95%
interval of that ratio from the rounds: the order statistics a sign test
gives). Scheme names as ``generate_speed.py`` (``4``, ``8,4``, ``codebook-3``,
``/h0``, ``/r0``, ...), plus ``/fill``: the cache filled with random normal
keys and values instead of a prefill through the model, then one prompt token;
``/halfprefill``: a codebook cache's prefill attending in the model's dtype
where it would take float32 (``codebook_kernel.prefill_in``); and
``name@span``: the decode kernels' keys per block fixed at ``span`` (128 or
more) during that scheme's turns (``decode_span``).

    python3 scripts/gpu/generate_interleaved.py --context 131072 \\
        --schemes 4 codebook-3 --out $OUT/interleaved.json
"""

import argparse
import contextlib
import itertools
import json
import math
import statistics
import time

import mlx.core as mx
from generate_speed import generation, make_cache, parse
from mlx_lm.generate import reserve_quantized_cache
from mlx_lm.models import quantized_decode

from omlx_cache import bench, codebook_kernel

SKIPPED = 2  # steps of a turn not counted


def split_span(name):
    """(the scheme, keys per block or 0) of ``name@span``: a span is a number
    of at least 128 after the last ``@`` (the ``@`` of a ``+kB@L`` layer
    list is the scheme's)."""
    base, sep, span = name.rpartition("@")
    if sep and span.isdigit() and int(span) >= 128:
        return base, int(span)
    return name, 0


@contextlib.contextmanager
def decode_span(span):
    """Keys per block of the decode kernels (patch 0011's launch layout,
    which the codebook kernel shares) fixed at ``span`` (0: as they choose)."""
    chosen = quantized_decode._decode_span
    if span:
        quantized_decode._decode_span = lambda length, n_rows: span
    quantized_decode._meta_tables.clear()
    try:
        yield
    finally:
        quantized_decode._decode_span = chosen
        quantized_decode._meta_tables.clear()


def split_name(name):
    """(the ``generate_speed.py`` scheme, whether ``/fill``, keys per block or
    0) of a scheme name here."""
    base, span = split_span(name)
    options = base.split("/")
    plain = "/".join(x for x in options if x not in ("fill", "halfprefill"))
    return plain, "fill" in options, span


def fill(model, cache, context, tokens):
    """Each layer's cache holding ``context`` random normal keys and values
    (affine caches reserve room for ``tokens`` more, as ``generate_step``
    does for a prompt)."""
    reserve_quantized_cache(cache, context + tokens)
    args = model.args
    head_dim = args.head_dim or args.hidden_size // args.num_attention_heads
    shape = (1, args.num_key_value_heads, context, head_dim)
    dtype = model.model.norm.weight.dtype
    for i, c in enumerate(cache):
        keys, values = (
            mx.random.normal(shape, key=mx.random.key(2 * i + j)).astype(dtype)
            for j in (0, 1)
        )
        c.update_and_fetch(keys, values)
        mx.eval(c.state)


def start(model, name, context, tokens, vocab):
    """A scheme's ``generate_step``, prefilled: (generator, first token s)."""
    plain, filled, _ = split_name(name)
    if {"nocopy", "clear"} & set(plain.split("/")):
        raise ValueError(f"{name!r}: /nocopy and /clear change the whole process")
    prefill_dtype = None
    if "halfprefill" in split_span(name)[0].split("/"):
        prefill_dtype = model.model.norm.weight.dtype
    prompt = bench.random_tokens(context, vocab, seed=context)[:, 0]
    cache, bits = make_cache(model, plain, context, tokens)
    if filled:
        fill(model, cache, context, tokens)
        prompt = prompt[-1:]
    tic = time.perf_counter()
    steps = generation(model, prompt, cache, bits, tokens)
    with codebook_kernel.prefill_in(prefill_dtype):
        next(steps)
    return steps, time.perf_counter() - tic


def turn(steps, n, name):
    """Seconds of each of ``n`` decode steps of scheme ``name``'s generator."""
    times = [time.perf_counter()]
    with decode_span(split_name(name)[2]):
        for _ in range(n):
            next(steps)
            times.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(times)]


def ratio_interval(ratios):
    """The median of ``ratios`` and a 95% interval for it from order
    statistics (binomial, p = 1/2); None where there are too few."""
    n = len(ratios)
    ordered = sorted(ratios)
    k = -1
    while sum(math.comb(n, i) for i in range(k + 2)) / 2**n <= 0.025:
        k += 1
    interval = None if k < 0 else (ordered[k], ordered[n - 1 - k])
    return statistics.median(ratios), interval


def turn_arguments(parser, blocks):
    """The options of a run whose schemes take turns (``--blocks`` rounds)."""
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(bench.PRESETS))
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--schemes", nargs="+", default=["4", "codebook-3"])
    parser.add_argument("--blocks", type=int, default=blocks, help="rounds of turns")
    parser.add_argument("--block-steps", type=int, default=16, help="steps per turn")
    parser.add_argument("--out", required=True)


def checked_model(parser, opts):
    """The preset's model once the schemes parse and turns are long enough."""
    for name in opts.schemes:
        try:
            parse(split_name(name)[0])
        except ValueError as e:
            parser.error(str(e))
    if opts.block_steps <= SKIPPED:
        parser.error(f"--block-steps must be more than {SKIPPED}")
    preset = bench.PRESETS[opts.preset]
    return bench.build_model(preset, getattr(mx, preset.get("dtype", "float16")))


def write_report(opts, rows, **fields):
    """The run's JSON at ``--out``."""
    report = {
        "preset": opts.preset,
        "context": opts.context,
        "blocks": opts.blocks,
        "block_steps": opts.block_steps,
        **fields,
        "device": str(mx.default_device()),
        "rows": rows,
    }
    with open(opts.out, "w") as f:
        json.dump(report, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    turn_arguments(parser, blocks=12)
    parser.add_argument(
        "--warmup", type=int, default=4608, help="context of an untimed round"
    )
    opts = parser.parse_args()
    model = checked_model(parser, opts)
    vocab = model.args.vocab_size
    tokens = opts.blocks * opts.block_steps + 2

    # compile every scheme's kernels in a short run first
    for name in opts.schemes:
        steps, _ = start(model, name, opts.warmup, 2 * opts.block_steps, vocab)
        turn(steps, opts.block_steps, name)
        del steps
    mx.clear_cache()

    generators, first_token = [], []
    for name in opts.schemes:
        steps, seconds = start(model, name, opts.context, tokens, vocab)
        generators.append(steps)
        first_token.append(seconds)
        print(
            f"{name:<12} prefilled {opts.context} tokens in {seconds:.2f} s", flush=True
        )

    counted = [[] for _ in opts.schemes]
    rounds = []
    for _ in range(opts.blocks):
        medians = []
        for name, steps, kept in zip(opts.schemes, generators, counted):
            times = turn(steps, opts.block_steps, name)[SKIPPED:]
            kept.extend(times)
            medians.append(statistics.median(times))
        rounds.append(medians)
    rows = []
    for i, name in enumerate(opts.schemes):
        ratios = [r[0] / r[i] for r in rounds]  # its tok/s over the first's
        median, interval = ratio_interval(ratios)
        row = {
            "scheme": name,
            "first_token_s": first_token[i],
            "decode_ms_median": 1e3 * statistics.median(counted[i]),
            "decode_tok_s": 1 / statistics.median(counted[i]),
            "vs_first_median": median,
            "vs_first_interval": interval,
            "rounds_faster_than_first": sum(x > 1 for x in ratios),
            "round_medians_ms": [1e3 * r[i] for r in rounds],
            "steps_ms": [round(1e3 * x, 3) for x in counted[i]],
        }
        rows.append(row)
        band = "" if interval is None else f" ({interval[0]:.3f}-{interval[1]:.3f})"
        print(
            f"{name:<12} decode {row['decode_tok_s']:.1f} tok/s (median step "
            f"{row['decode_ms_median']:.2f} ms), vs {opts.schemes[0]}: "
            f"{median:.3f}x{band}, faster in {row['rounds_faster_than_first']} "
            f"of {opts.blocks} rounds",
            flush=True,
        )
    write_report(opts, rows, skipped_per_turn=SKIPPED)


if __name__ == "__main__":
    main()
