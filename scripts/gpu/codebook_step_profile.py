"""Where a codebook cache's decode step goes, against affine 4-bit (GPU machine).

A bench preset's model (Llama-3-8B shape by default, random 4-bit weights),
its caches filled with random keys and values up to each context (one page,
as ``generate_step`` reserves), then per scheme, in one process, ms per
decode step (all layers), median over the steps:

- ``generate``: ``mlx_lm``'s ``generate_step`` (pipelined, as
  ``generate_speed.py``), the interval between tokens; ``--repeats`` runs;
- ``forward``: the model on one token, evaluated each step: ``build``
  (Python builds the graph), ``launch`` (``mx.async_eval``: the host encodes
  the kernels while the device starts on them), ``wait`` (the device
  finishing) and ``total``;
- ``attn_update``: per layer the cache's ``update_and_fetch`` of one token and
  the attention of a fixed query (``base.scaled_dot_product_attention``), all
  layers evaluated together each step;
- ``attn_layers``: the attention alone (no update) over every layer's cache,
  evaluated together (pages read from memory, as in decode);
- ``attn_one_layer``: the attention alone over one layer's cache as many times
  as there are layers (its pages stay in L2, as ``codebook_kernel_check.py``
  timed the kernel);
- with ``--python-profile``, ``python``: cProfile over building the forward's
  graph (each step evaluated outside the profile), the functions with the most
  time of their own, in ms per step: on this machine a decode step's host
  time (building the graph, then launching it) is most of the step.

A scheme written ``name@span`` runs with the decode kernels' keys per block
fixed at ``span``, 128 or more (patch 0011's layout, shared by the codebook
kernel).

The kernels run on CUDA (``codebook_kernel``, patch 0011); elsewhere the
MLX-ops paths (useful only to check the script):

    python3 scripts/gpu/codebook_step_profile.py --contexts 32768,131072 \\
        --out $OUT/codebook-step-profile.json
    python3 scripts/gpu/codebook_step_profile.py --preset tiny-cpu --contexts 512 \\
        --warmup 256 --steps 8 --out /tmp/profile.json
"""

import argparse
import contextlib
import cProfile
import itertools
import json
import pstats
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import quantized_decode
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import make_prompt_cache

from omlx_cache import bench
from omlx_cache.schemes import get_scheme

FILL_CHUNK = 8192


def kv_bits(name):
    """The affine scheme's ``kv_bits`` (None for a codebook scheme)."""
    if name.startswith("codebook"):
        return None
    bits = tuple(int(b) for b in name.split(","))
    return bits if len(bits) == 2 else bits[0]


def make_caches(model, name, tokens):
    """Empty caches whose first page holds ``tokens``."""
    if name.startswith("codebook"):
        caches = get_scheme(name).make_cache(model)
        for c in caches:
            c.page_size = tokens
        return caches
    caches = make_prompt_cache(model, kv_bits=kv_bits(name))
    for c in caches:
        c.reserve = tokens
    return caches


def fill(caches, args, context, dtype):
    """``context`` random tokens in every layer, written a chunk at a time."""
    n_kv, head_dim = args.num_key_value_heads, args.head_dim
    chunk = mx.random.normal((1, n_kv, min(FILL_CHUNK, context), head_dim))
    chunk = chunk.astype(dtype)
    for c in caches:
        for start in range(0, context, FILL_CHUNK):
            part = chunk[:, :, : min(FILL_CHUNK, context - start)]
            c.update_and_fetch(part, part)
            mx.eval(c.key_pages, c.value_pages)


def median_ms(seconds):
    return 1e3 * statistics.median(seconds)


def timed_steps(build, steps, warmup=2):
    """Median ms of building a step's outputs, evaluating them, and both; of
    the evaluation, ``launch_ms`` is ``mx.async_eval``'s own time (the host
    encoding every kernel) and ``wait_ms`` the rest (the device finishing)."""
    builds, launches, waits = [], [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        outputs = build()
        built = time.perf_counter()
        mx.async_eval(outputs)
        launched = time.perf_counter()
        mx.eval(outputs)
        done = time.perf_counter()
        if i >= warmup:
            builds.append(built - start)
            launches.append(launched - built)
            waits.append(done - launched)
    evals = [a + b for a, b in zip(launches, waits)]
    totals = [a + b for a, b in zip(builds, evals)]
    return {
        "build_ms": median_ms(builds),
        "eval_ms": median_ms(evals),
        "launch_ms": median_ms(launches),
        "wait_ms": median_ms(waits),
        "total_ms": median_ms(totals),
    }


def generate_ms(model, caches, name, steps):
    """Median interval between ``generate_step``'s tokens, from one token on
    the filled caches."""
    times = []
    prompt = mx.array([1])
    for _ in generate_step(
        prompt, model, max_tokens=steps + 1, prompt_cache=caches, kv_bits=kv_bits(name)
    ):
        times.append(time.perf_counter())
    return median_ms([b - a for a, b in itertools.pairwise(times)])


def forward(model, caches):
    token = mx.array([[1]])
    return lambda: model(token, cache=caches)


def attention_inputs(args, dtype):
    """A fixed query, key and value of one token, and the attention scale."""
    shape = (1, args.num_attention_heads, 1, args.head_dim)
    query = mx.random.normal(shape).astype(dtype)
    kv = mx.random.normal((1, args.num_key_value_heads, 1, args.head_dim))
    kv = kv.astype(dtype)
    mx.eval(query, kv)
    return query, kv, args.head_dim**-0.5


def attend_and_update(caches, inputs):
    query, kv, scale = inputs

    def build():
        outputs = []
        for c in caches:
            keys, values = c.update_and_fetch(kv, kv)
            outputs.append(
                scaled_dot_product_attention(
                    query, keys, values, cache=c, scale=scale, mask=None
                )
            )
        return outputs

    return build


def attend(caches, inputs):
    """Attention alone over ``caches`` (the pages as they are, held tokens
    included)."""
    query, _, scale = inputs

    def build():
        return [
            c.scaled_dot_product_attention(
                query, c.key_pages, c.value_pages, scale=scale, mask=None
            )
            for c in caches
        ]

    return build


def python_profile(build, steps, top=30):
    """The ``top`` functions by own time over ``steps`` graph builds (ms per
    step), each step evaluated outside the profile."""
    profiler = cProfile.Profile()
    for _ in range(steps):
        profiler.enable()
        outputs = build()
        profiler.disable()
        mx.eval(outputs)
    stats = pstats.Stats(profiler).stats
    rows = []
    for (path, line, func), (_, calls, own, cumulative, _) in stats.items():
        rows.append(
            {
                "function": f"{path.rsplit('/', 2)[-1]}:{line}({func})",
                "calls_per_step": calls / steps,
                "own_ms": 1e3 * own / steps,
                "cumulative_ms": 1e3 * cumulative / steps,
            }
        )
    rows.sort(key=lambda r: -r["own_ms"])
    total = sum(r["own_ms"] for r in rows)
    return {"total_ms": total, "top": rows[:top]}


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


def profile(model, scheme, context, opts):
    """One scheme (``name`` or ``name@span``) at one context: the row of
    every measurement."""
    name, span = split_span(scheme)
    with decode_span(span):
        row = _profile(model, name, context, opts)
    row["scheme"] = scheme
    return row


def _profile(model, name, context, opts):
    args = model.args
    dtype = opts.dtype
    new_tokens = (opts.repeats + 2) * (opts.steps + 4) + 8
    caches = make_caches(model, name, context + new_tokens)
    fill(caches, args, context, dtype)
    row = {"context": context, "scheme": name}
    runs = [generate_ms(model, caches, name, opts.steps) for _ in range(opts.repeats)]
    row["generate_ms"] = statistics.median(runs)
    row["generate_ms_runs"] = runs
    row["generate_tok_s"] = 1e3 / row["generate_ms"]
    row["forward"] = timed_steps(forward(model, caches), opts.steps)
    inputs = attention_inputs(args, dtype)
    row["attn_update"] = timed_steps(attend_and_update(caches, inputs), opts.steps)
    row["attn_layers"] = timed_steps(attend(caches, inputs), opts.steps)
    one_layer = [caches[0]] * len(caches)
    row["attn_one_layer"] = timed_steps(attend(one_layer, inputs), opts.steps)
    if opts.python_profile:
        row["python"] = python_profile(forward(model, caches), opts.steps)
        print(f"{name} at {context}: python {row['python']['total_ms']:.2f} ms/step")
        for r in row["python"]["top"][:12]:
            print(
                f"  {r['own_ms']:6.3f} own {r['cumulative_ms']:6.3f} cum "
                f"{r['calls_per_step']:5.0f} calls  {r['function']}"
            )
    row["held_tokens"] = getattr(caches[0], "n_held", getattr(caches[0], "_n_held", 0))
    row["offset"] = caches[0].offset
    del caches
    mx.clear_cache()
    return row


PARTS = ("forward", "attn_update", "attn_layers", "attn_one_layer")


def print_header():
    cols = ["context", "scheme", "generate"]
    for part in PARTS:
        cols += [f"{part} build", "launch", "wait", "total"]
    print(" | ".join(cols), flush=True)


def print_row(row, affine):
    cells = [str(row["context"]), row["scheme"], f"{row['generate_ms']:.2f}"]
    for part in PARTS:
        m = row[part]
        cells += [
            f"{m[k]:.2f}" for k in ("build_ms", "launch_ms", "wait_ms", "total_ms")
        ]
    line = " | ".join(cells)
    if affine and affine is not row:
        line += f"  [generate tok/s {row['generate_vs_4']:.2f}x 4's]"
    print(line, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(bench.PRESETS))
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument(
        "--schemes", nargs="+", default=["4", "codebook-3", "codebook-3k-4v"]
    )
    parser.add_argument("--steps", type=int, default=32, help="timed steps per part")
    parser.add_argument("--repeats", type=int, default=2, help="generate_step runs")
    parser.add_argument(
        "--warmup", type=int, default=4096, help="context of an untimed pass"
    )
    parser.add_argument(
        "--python-profile", action="store_true", help="cProfile the graph building"
    )
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    preset = bench.PRESETS[opts.preset]
    opts.dtype = getattr(mx, preset.get("dtype", "float16"))
    model = bench.build_model(preset, opts.dtype)
    report = {"preset": opts.preset, "steps": opts.steps, "warmup": [], "rows": []}
    start = time.perf_counter()
    for name in opts.schemes:
        report["warmup"].append(profile(model, name, opts.warmup, opts))
    print(f"warm-up at {opts.warmup}: {time.perf_counter() - start:.1f} s", flush=True)
    print_header()
    for context in bench.int_list(opts.contexts):
        affine = None
        for name in opts.schemes:
            row = profile(model, name, context, opts)
            affine = row if name == "4" else affine
            if affine:
                row["generate_vs_4"] = affine["generate_ms"] / row["generate_ms"]
            report["rows"].append(row)
            print_row(row, affine)
            with open(opts.out, "w") as f:
                json.dump(report, f, indent=1)
    print(f"done in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
