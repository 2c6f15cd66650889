"""Speed and memory of quantized KV caches: ours and upstream mlx-lm's, side by side.

For each context length and scheme, one process measures the peak memory of a
chunked prefill (as in mlx-lm's ``generate_step``), the cache's bytes and the
decode speed at that context, twice: evaluating each step before building the
next ("decode"), and queueing the next step before waiting for the previous
one, as ``generate_step`` does ("pipelined", where Python's graph building
overlaps the device). Upstream schemes run the unpatched mlx-lm
(``vendor/pristine``, extracted from the vendored repo's ``upstream`` tag)
with the same weights as the patched model.

    python -m omlx_cache.bench                      # CPU-sized, a few minutes
    python -m omlx_cache.bench --preset llama3-8b --contexts 4096,32768 \\
        --out bench.json --plot-dir docs --plot-prefix bench-gpu
    python -m omlx_cache.bench --merge a.json b.json --out all.json
    python -m omlx_cache.bench --preset llama3-8b --batch 8 --fill synthetic \
        --schemes fp16 8,4 4       # batched decode, as the server batches streams

Schemes: ``fp16`` (mlx-lm's ``KVCache``, in the model's dtype), ``upstream-B``
(upstream's ``QuantizedKVCache`` from the first token), ``upstream-B@S``
(upstream's default path: ``KVCache`` until S tokens, then converted), and
ours: ``B`` or ``KB,VB`` (patched ``QuantizedKVCache``), ``+reserve`` to
reserve the whole context up front, ``/pN`` for a page size of N tokens,
``/hN`` to hold N decode tokens unquantized (``QuantizedKVCache.decode_buffer``;
``/h0``: quantize each one as it comes).
Any other name is a scheme of ``omlx_cache.schemes`` (as ``python -m
omlx_cache.eval --kv`` takes them), e.g. ``4+rotate``, ``codebook-3`` or
``codebook-3k-4v+center``.
"""

import argparse
import faulthandler
import gc
import importlib
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx import nn
from mlx_lm.models import llama
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchQuantizedKVCache,
    KVCache,
    QuantizedKVCache,
    check_kv_quantization,
)

from . import schemes as kv_schemes

REPO_ROOT = Path(__file__).resolve().parents[1]
VENDOR = REPO_ROOT / "vendor"
PRISTINE = "mlx_lm_pristine"
PROCESS_START = time.perf_counter()
GIB = 1 << 30
MIB = 1 << 20

LLAMA_DEFAULTS = {"model_type": "llama", "rms_norm_eps": 1e-5, "rope_theta": 10000.0}

# Random weights at real shapes: speed and memory do not depend on the values.
PRESETS = {
    "llama3-8b": {
        "config": {
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 128256,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
        },
        "dtype": "float16",
        "weights": (64, 4),
        "contexts": (4096, 16384, 32768),
    },
    "smollm2": {
        "config": {
            "hidden_size": 576,
            "num_hidden_layers": 30,
            "intermediate_size": 1536,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "vocab_size": 49152,
            "rope_theta": 100000.0,
            "tie_word_embeddings": True,
        },
        "dtype": "float16",
        "weights": None,
        "contexts": (1024, 4096),
    },
    # Gemma 3 270M's shape in a llama block (every layer full attention).
    "gemma3-270m": {
        "config": {
            "hidden_size": 640,
            "num_hidden_layers": 18,
            "intermediate_size": 2048,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "vocab_size": 262144,
            "tie_word_embeddings": True,
        },
        "dtype": "float16",
        "weights": None,
        "contexts": (1024, 4096),
    },
    # float32: on the CPU, quantized matmul is about 40x slower in float16.
    # Two layers and four query heads keep the default run to a few minutes.
    "tiny-cpu": {
        "config": {
            "hidden_size": 256,
            "num_hidden_layers": 2,
            "intermediate_size": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "vocab_size": 1024,
            "tie_word_embeddings": True,
        },
        "dtype": "float32",
        "weights": None,
        "contexts": (1024, 2048, 4096),
    },
}

DEFAULT_SCHEMES = (
    "fp16",
    "upstream-8",
    "upstream-4",
    "upstream-4@5000",
    "8",
    "8,4",
    "4",
    "8+reserve",
    "8,4+reserve",
    "4+reserve",
)


def log(*parts):
    elapsed = time.perf_counter() - PROCESS_START
    print(f"[{elapsed:5.0f} s]", *parts, file=sys.stderr, flush=True)


# --- upstream (unpatched) mlx-lm -------------------------------------------


def extract_pristine(root: Path = VENDOR / "pristine"):
    """Extract mlx-lm's pristine sdist (tag ``upstream``) into ``root``."""
    if (root / "mlx_lm" / "__init__.py").exists():
        return root
    log(f"bench: {root} is missing: extracting upstream mlx-lm (tag 'upstream') there")
    root.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(VENDOR / "mlx-lm"), "archive", "upstream", "mlx_lm"],
        check=True,
        capture_output=True,
    )
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    return root


def import_pristine(root: Path = VENDOR / "pristine"):
    """The pristine ``models.llama`` and ``models.cache``, imported as
    ``mlx_lm_pristine``. The package's ``__init__`` is not run: it loads the
    generation and conversion code, which the models do not need."""
    if PRISTINE not in sys.modules:
        package = extract_pristine(root) / "mlx_lm"
        spec = importlib.util.spec_from_file_location(
            PRISTINE,
            package / "__init__.py",
            submodule_search_locations=[str(package)],
        )
        sys.modules[PRISTINE] = importlib.util.module_from_spec(spec)
    pristine_llama = importlib.import_module(f"{PRISTINE}.models.llama")
    pristine_cache = importlib.import_module(f"{PRISTINE}.models.cache")
    return pristine_llama, pristine_cache


def pristine_version(root: Path = VENDOR / "pristine") -> str | None:
    path = root / "mlx_lm" / "_version.py"
    text = path.read_text() if path.exists() else ""
    found = re.search(r"__version__ = [\"'](.+)[\"']", text)
    return found and found.group(1)


# --- models ------------------------------------------------------------------


def model_args(module, preset: dict):
    return module.ModelArgs.from_dict({**LLAMA_DEFAULTS, **preset["config"]})


def finish_module(module: nn.Module, dtype, weights):
    """Cast (and quantize) one module's random weights and evaluate them, so
    the float32 originals of only this module exist at a time."""
    module.set_dtype(dtype)
    if weights is not None:
        group_size, bits = weights
        nn.quantize(
            module,
            group_size=group_size,
            bits=bits,
            class_predicate=lambda _, m: isinstance(m, (nn.Linear, nn.Embedding)),
        )
    mx.eval(module.parameters())


def build_model(preset: dict, dtype, seed: int = 0):
    """The patched llama at ``preset``'s shape, with random weights."""
    mx.random.seed(seed)
    model = llama.Model(model_args(llama, preset))
    for layer in model.model.layers:
        finish_module(layer, dtype, preset["weights"])
    finish_module(model, dtype, preset["weights"])
    return model


def build_models(preset: dict, dtype, seed: int = 0):
    """The patched and the pristine llama with one set of weights."""
    ours = build_model(preset, dtype, seed)
    pristine_llama, _ = import_pristine()
    upstream = pristine_llama.Model(model_args(pristine_llama, preset))
    if preset["weights"] is not None:
        group_size, bits = preset["weights"]
        nn.quantize(upstream, group_size=group_size, bits=bits)
    upstream.update(ours.parameters())
    return ours, upstream


def lm_head(model, hidden):
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)


# --- schemes -----------------------------------------------------------------


@dataclass(frozen=True)
class Scheme:
    name: str
    kind: str  # "fp", "upstream", "ours" or "named" (omlx_cache.schemes)
    bits: tuple[int, int] = (16, 16)
    reserve: bool = False
    page_size: int | None = None
    decode_buffer: int | None = None
    quantized_start: int = 0

    @property
    def counterpart(self) -> str | None:
        """The upstream scheme that ours is compared with: same bits, or the
        smaller of a (key, value) pair."""
        if self.kind != "ours":
            return None
        return f"upstream-{min(self.bits)}"


OURS = re.compile(r"\d+(,\d+)?(\+reserve)?(/p\d+)?(/h\d+)?")


def parse_scheme(name: str) -> Scheme:
    if name == "fp16":
        return Scheme(name, "fp")
    if not name.startswith("upstream-") and not OURS.fullmatch(name):
        kv_schemes.get_scheme(name)  # a clear error for an unknown name
        return Scheme(name, "named")
    base, _, held = name.partition("/h")
    base, _, page = base.partition("/p")
    page_size = int(page) if page else None
    if base.startswith("upstream-"):
        bits, _, start = base.removeprefix("upstream-").partition("@")
        bits = int(bits)
        check_kv_quantization(64, bits)
        return Scheme(name, "upstream", (bits, bits), quantized_start=int(start or 0))
    reserve = base.endswith("+reserve")
    bits = tuple(int(b) for b in base.removesuffix("+reserve").split(","))
    _, bits = check_kv_quantization(64, bits if len(bits) > 1 else bits[0])
    decode_buffer = int(held) if held else None
    return Scheme(name, "ours", bits, reserve, page_size, decode_buffer)


@contextmanager
def setting(owner, name: str, value):
    """Set ``owner.name`` to ``value`` (unless None) for a while."""
    old = getattr(owner, name)
    setattr(owner, name, old if value is None else value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def page_size(size: int | None):
    return setting(QuantizedKVCache, "page_size", size)


def decode_buffer(size: int | None):
    return setting(QuantizedKVCache, "decode_buffer", size)


def make_cache(
    scheme: Scheme,
    n_layers: int,
    tokens: int,
    group_size: int,
    upstream,
    model=None,
    batch: int = 1,
):
    if batch > 1:
        return make_batch_cache(scheme, n_layers, group_size, batch)
    if scheme.kind == "named":
        return kv_schemes.get_scheme(scheme.name, group_size).make_cache(model)
    if scheme.kind == "fp":
        return [KVCache() for _ in range(n_layers)]
    if scheme.kind == "upstream":
        if scheme.quantized_start:
            return [upstream.KVCache() for _ in range(n_layers)]
        bits = scheme.bits[0]
        return [upstream.QuantizedKVCache(group_size, bits) for _ in range(n_layers)]
    reserve = tokens if scheme.reserve else None
    return [
        QuantizedKVCache(group_size, scheme.bits, reserve=reserve)
        for _ in range(n_layers)
    ]


def make_batch_cache(scheme: Scheme, n_layers: int, group_size: int, batch: int):
    """The caches of mlx-lm's batched generation (``BatchGenerator``): left
    padding, the mask that drops it."""
    padding = left_padding(batch)
    if scheme.kind == "fp":
        return [BatchKVCache(padding) for _ in range(n_layers)]
    if scheme.kind == "ours" and not scheme.reserve:
        return [
            BatchQuantizedKVCache(padding, group_size, scheme.bits)
            for _ in range(n_layers)
        ]
    raise ValueError(f"--batch takes fp16 and our B or K,V schemes, not {scheme.name}")


def converter(scheme: Scheme, group_size: int):
    """What generate_step does after each model call: upstream's
    ``maybe_quantize_kv_cache`` for the ``upstream-B@S`` schemes."""

    def convert(cache):
        for i, c in enumerate(cache):
            if hasattr(c, "to_quantized") and c.offset >= scheme.quantized_start:
                cache[i] = c.to_quantized(group_size=group_size, bits=scheme.bits[0])

    if scheme.kind == "upstream" and scheme.quantized_start:
        return convert
    return lambda cache: None


# --- one measurement -----------------------------------------------------------


class BudgetExceeded(Exception):
    pass


@dataclass
class Setup:
    ours: Any
    upstream: Any
    upstream_cache: Any
    options: argparse.Namespace
    weights_bytes: int
    # fp16's logits (after prefill, at the first decode step) by context
    references: dict[int, tuple[mx.array, mx.array]] = field(default_factory=dict)


def random_tokens(n: int, vocab: int, seed: int, batch: int = 1) -> mx.array:
    """(n, batch) tokens: a column per sequence."""
    return mx.random.randint(0, vocab, (n, batch), key=mx.random.key(seed))


def left_padding(batch: int) -> list[int]:
    """The batch's padding (``--batch``): sequence i starts 37 * i tokens in,
    as a batch of prompts of different lengths does."""
    return [37 * i for i in range(batch)]


def prefill(model, prompt, cache, step, after_call, deadline):
    """Chunked prefill as in generate_step; the last chunk's hidden state is
    evaluated too, so the last layer's attention is computed. Returns the
    logits of the last position."""
    n = prompt.shape[0]
    for start in range(0, n, step):
        hidden = model.model(prompt[start : start + step].T, cache=cache)
        after_call(cache)
        last = hidden[:, -1:, :]
        mx.eval([c.state for c in cache], last)
        mx.clear_cache()
        if time.perf_counter() > deadline and start + step < n:
            done = start + step
            raise BudgetExceeded(f"prefill stopped by the budget at {done}/{n} tokens")
    logits = lm_head(model, last)
    mx.eval(logits)
    return logits.reshape(-1)


def synthetic_fill(model, prompt, cache, step, after_call, deadline):
    """Fill every layer's cache with random keys and values, ``step`` tokens
    at a time, as many as ``prompt`` has (and for as many sequences), without
    running the model: decode speed does not depend on the values, and no
    prefill attention runs. Returns no logits."""
    context, batch = prompt.shape
    attention = model.model.layers[0].self_attn
    shape = (batch, attention.n_kv_heads, step, attention.head_dim)
    dtype = model.model.norm.weight.dtype
    for start in range(0, context, step):
        n = min(step, context - start)
        keys, values = mx.random.normal((2, *shape), key=mx.random.key(start))
        keys, values = keys[..., :n, :].astype(dtype), values[..., :n, :].astype(dtype)
        for c in cache:
            c.update_and_fetch(keys, values)
        after_call(cache)
        mx.eval([c.state for c in cache])
        mx.clear_cache()
        if time.perf_counter() > deadline and start + step < context:
            done = start + step
            raise BudgetExceeded(f"fill stopped by the budget at {done}/{context}")


def decode(model, cache, tokens, after_call, deadline, min_steps=3):
    """Single-token steps: the per-step times and the first step's logits."""
    times, first = [], None
    for i in range(tokens.shape[0]):
        tic = time.perf_counter()
        logits = model(tokens[i : i + 1].T, cache=cache)
        after_call(cache)
        mx.eval(logits)
        times.append(time.perf_counter() - tic)
        if first is None:
            first = logits.reshape(-1)
        if time.perf_counter() > deadline and len(times) >= min_steps:
            break
    return times, first


def decode_pipelined(model, cache, tokens, after_call, deadline, min_steps=3):
    """Single-token steps as mlx-lm's ``generate_step`` runs them: each
    step's graph is built and queued (``mx.async_eval``) before the previous
    step's result is waited for, so Python overlaps the device. The times are
    the intervals between consecutive results; the last token is only queued
    behind the last timed step, so that every timed step had one behind it."""

    def queue(i):
        logits = model(tokens[i : i + 1].T, cache=cache)
        after_call(cache)
        mx.async_eval(logits)
        return logits

    return pipelined_intervals(queue, tokens.shape[0], deadline, min_steps)


def pipelined_intervals(queue, n_steps, deadline=math.inf, min_steps=3):
    """Seconds between consecutive results of steps 0 to ``n_steps - 1``, each
    queued by ``queue(i)`` (which builds and ``mx.async_eval``s step i) before
    the previous one is waited for. The last step is only queued, so that
    every timed step had one behind it; past ``deadline`` (perf_counter) the
    loop stops once ``min_steps`` are timed."""
    times = []
    pending = queue(0)
    tic = time.perf_counter()
    for i in range(1, n_steps):
        following = queue(i)
        mx.eval(pending)
        times.append(time.perf_counter() - tic)
        tic = time.perf_counter()
        pending = following
        if tic > deadline and len(times) >= min_steps:
            break
    mx.eval(pending)
    return times


def rel_err(x: mx.array, ref: mx.array) -> float:
    x, ref = x.astype(mx.float32), ref.astype(mx.float32)
    err = mx.linalg.norm(x - ref) / mx.maximum(mx.linalg.norm(ref), 1e-30)
    return float(err.item())


def run_case(setup: Setup, scheme: Scheme, context: int, sweep: bool = False):
    """Measure one (scheme, context); raises on errors and budget overruns."""
    opts = setup.options
    model = setup.upstream if scheme.kind == "upstream" else setup.ours
    n_layers = len(model.model.layers)
    vocab = model.args.vocab_size
    n_decode = opts.decode_warmup + opts.decode_tokens
    modes = DECODE_MODES[opts.decode_mode]
    batch = opts.batch
    prompt = random_tokens(context, vocab, seed=context, batch=batch)
    # the pipelined loop queues one token past its timed steps
    steps = random_tokens(
        n_decode * len(modes) + 1, vocab, seed=context + 1, batch=batch
    )
    mx.eval(prompt, steps)
    budget = opts.case_budget or math.inf
    after_call = converter(scheme, opts.kv_group_size)
    row = case_row(scheme, context, sweep, opts)

    with page_size(scheme.page_size), decode_buffer(scheme.decode_buffer):
        cache = make_cache(
            scheme,
            n_layers,
            context + steps.shape[0],
            opts.kv_group_size,
            setup.upstream_cache,
            model,
            batch,
        )
        gc.collect()
        mx.clear_cache()
        active = mx.get_active_memory()
        mx.reset_peak_memory()
        tic = time.perf_counter()
        fill = synthetic_fill if opts.fill == "synthetic" else prefill
        logits = fill(model, prompt, cache, opts.prefill_step, after_call, tic + budget)
        prefill_s = time.perf_counter() - tic
        peak = mx.get_peak_memory()
        kv_bytes = sum(c.nbytes for c in cache)
        row.update(
            page_size=QuantizedKVCache.page_size if scheme.kind == "ours" else None,
            active_before_bytes=active,
            kv_bytes=kv_bytes,
            peak_bytes=peak,
            workspace_bytes=peak - active - kv_bytes,
            prefill_s=prefill_s,
            prefill_tok_s=context * batch / prefill_s,
        )
        mx.reset_peak_memory()
        deadline = time.perf_counter() + max(budget - prefill_s, 0)
        try:
            first = None
            for mode in modes:
                if mode == "sync":
                    sync_steps = steps[:n_decode]
                    times, first = decode(
                        model, cache, sync_steps, after_call, deadline
                    )
                else:
                    start = n_decode if "sync" in modes else 0
                    times = decode_pipelined(
                        model,
                        cache,
                        steps[start : start + n_decode + 1],
                        after_call,
                        deadline,
                    )
                key = DECODE_KEYS[mode]
                add_decode_times(row, times, opts.decode_warmup, key, batch)
        # upstream's decode attention raises on CUDA: keep the prefill numbers
        except Exception as e:  # noqa: BLE001
            row["decode_error"] = f"{type(e).__name__}: {e}"
            add_errors(row, setup, scheme, context, logits, None)
            return row
        row["decode_peak_bytes"] = mx.get_peak_memory()
    add_floor(row, setup)
    add_errors(row, setup, scheme, context, logits, first)
    return row


# --decode-mode: which decode loops run, in order (the synchronous loop's first
# logits are the ones compared with fp16's)
DECODE_MODES = {
    "sync": ("sync",),
    "pipelined": ("pipelined",),
    "both": ("sync", "pipelined"),
}
# row keys: "decode_*" for the synchronous loop (as in earlier runs),
# "decode_pipelined_*" for generate_step's overlapped loop
DECODE_KEYS = {"sync": "decode", "pipelined": "decode_pipelined"}


def add_decode_times(row: dict, times: list, warmup: int, key: str, batch: int):
    """Per-step times, and tokens/s over the batch's sequences: from the
    median step, and from the steps' total time (a pipelined loop's steps
    alternate long and short, which the median does not average out)."""
    timed = times[warmup:] or times[-1:]
    median = statistics.median(timed)
    mean = statistics.mean(timed)
    row.update(
        {
            f"{key}_steps": len(timed),
            f"{key}_ms": [round(t * 1e3, 3) for t in timed],
            f"{key}_ms_median": median * 1e3,
            f"{key}_ms_mean": mean * 1e3,
            f"{key}_ms_min": min(timed) * 1e3,
            f"{key}_tok_s": batch / median,
            f"{key}_tok_s_mean": batch / mean,
        }
    )


def add_floor(row: dict, setup: Setup):
    """Bytes every decode step must read over the memory bandwidth."""
    bandwidth = setup.options.bandwidth_gbs
    if not bandwidth:
        return
    row["kv_floor_ms"] = row["kv_bytes"] / (bandwidth * 1e9) * 1e3
    weights = setup.weights_bytes
    row["floor_ms"] = (row["kv_bytes"] + weights) / (bandwidth * 1e9) * 1e3


def add_errors(row, setup, scheme, context, prefill_logits, decode_logits):
    """Relative error of the logits against ``fp16`` at the same context."""
    if scheme.kind == "fp":
        setup.references[context] = (prefill_logits, decode_logits)
    if context not in setup.references:
        return
    ref_prefill, ref_decode = setup.references[context]
    if prefill_logits is not None and ref_prefill is not None:
        row["prefill_logits_rel_err"] = rel_err(prefill_logits, ref_prefill)
    if decode_logits is not None and ref_decode is not None:
        row["decode_logits_rel_err"] = rel_err(decode_logits, ref_decode)


# --- which quantized matmuls the backend runs ---------------------------------


def probe_case(rows, tile, n_kv_heads, head_dim, bits, sliced, transpose):
    """One attention matmul of a tile of ``tile`` keys: the scores
    (``transpose``, queries @ keys^T) or the output (probs @ values). The tile
    is a whole page, or a slice of a page four times as long."""
    page = 4 * tile if sliced else tile
    data = mx.random.normal((1, n_kv_heads, page, head_dim)).astype(mx.float16)
    packed = mx.quantize(data, group_size=64, bits=bits)
    if sliced:
        packed = tuple(x[..., tile : 2 * tile, :] for x in packed)
    width = head_dim if transpose else tile
    x = mx.random.normal((1, n_kv_heads, rows, width)).astype(mx.float16)
    mx.eval(x, packed)

    def step():
        out = mx.quantized_matmul(
            x, *packed, transpose=transpose, group_size=64, bits=bits
        )
        mx.eval(out)

    try:
        step()
        times = []
        for _ in range(3):
            tic = time.perf_counter()
            step()
            times.append(time.perf_counter() - tic)
        return f"ok {statistics.median(times) * 1e3:.3f} ms"
    except Exception as e:  # noqa: BLE001 (the point is to record it)
        return f"{type(e).__name__}: {e}"[:160]


def probe(n_kv_heads: int = 8, head_dim: int = 128, tile: int = 256) -> list[dict]:
    """Which of the tiled attention's quantized matmuls run here: a whole
    page as the tile or a slice of a longer page, decode (4 query rows per
    key head) or a 2048-token prefill chunk (8192 rows)."""
    results = []
    for rows in (4, 8192):
        for bits in (4, 8):
            for sliced in (False, True):
                for transpose in (True, False):
                    result = probe_case(
                        rows, tile, n_kv_heads, head_dim, bits, sliced, transpose
                    )
                    results.append(
                        {
                            "rows": rows,
                            "bits": bits,
                            "tile": "slice of a page" if sliced else "whole page",
                            "matmul": "scores" if transpose else "output",
                            "result": result,
                        }
                    )
                    log(f"bench: probe {results[-1]}")
    return results


# --- the run -----------------------------------------------------------------


def case_row(scheme: Scheme, context: int, sweep: bool, opts) -> dict:
    return {
        "context": context,
        "scheme": scheme.name,
        "sweep": sweep,
        "fill": opts.fill,
        "prefill_step": opts.prefill_step,
        "batch": opts.batch,
    }


class Runner:
    """Runs the cases in order, keeps the JSON on disk up to date after each
    one, and skips what the budgets rule out."""

    def __init__(self, setup: Setup, report: dict):
        self.setup = setup
        self.report = report
        self.over_budget = set()

    def save(self):
        out = self.setup.options.out
        self.report["elapsed_s"] = time.perf_counter() - PROCESS_START
        if out:
            write_json(out, self.report)

    def skip_reason(self, scheme: Scheme) -> str | None:
        opts = self.setup.options
        if opts.deadline and time.perf_counter() - PROCESS_START > opts.deadline:
            return f"skipped: the run's deadline ({opts.deadline:g} s) has passed"
        if scheme.name in self.over_budget:
            return "skipped: over the case budget at a smaller context"
        return None

    def grid(self, schemes: list[Scheme], contexts: list[int]):
        """Every scheme at every context, after an untimed warm-up."""
        warmup = self.setup.options.warmup
        if warmup and schemes:
            errors = warm_up(self.setup, schemes, warmup)
            self.report.setdefault("warmup_errors", {}).update(errors)
        for context in contexts:
            for scheme in schemes:
                self.run(scheme, context)

    def sweep(self, schemes: list[Scheme], context: int):
        """More schemes (page sizes) at one context, with fp16 for reference."""
        self.over_budget.clear()
        fill = self.setup.options.fill
        for scheme in [parse_scheme("fp16")] + schemes if schemes else []:
            if not find(self.report["rows"], context, scheme.name, fill=fill):
                self.run(scheme, context, sweep=scheme.kind != "fp")

    def run(self, scheme: Scheme, context: int, sweep: bool = False):
        row = case_row(scheme, context, sweep, self.setup.options)
        reason = self.skip_reason(scheme)
        if reason:
            row["skipped"] = reason
        else:
            log(f"bench: {scheme.name} at {context} tokens{' (sweep)' * sweep}")
            self.report["running"] = row
            self.save()
            row = self.guarded(scheme, context, sweep)
        self.report["running"] = None
        self.report["rows"].append(row)
        self.save()
        log("bench:   " + summary(row))
        return row

    def guarded(self, scheme, context, sweep):
        timeout = self.setup.options.case_timeout
        if timeout:
            # a hung kernel cannot be interrupted: end the process, whose JSON
            # already names the running case
            faulthandler.dump_traceback_later(timeout, exit=True)
        row = case_row(scheme, context, sweep, self.setup.options)
        try:
            return run_case(self.setup, scheme, context, sweep)
        except BudgetExceeded as e:
            self.over_budget.add(scheme.name)
            budget = self.setup.options.case_budget
            return {**row, "skipped": f"{e} ({budget:g} s budget)"}
        # upstream's quantized attention raises on CUDA; any error is recorded
        except Exception as e:  # noqa: BLE001
            return {**row, "error": f"{type(e).__name__}: {e}"}
        finally:
            if timeout:
                faulthandler.cancel_dump_traceback_later()
            gc.collect()
            mx.clear_cache()


def summary(row: dict) -> str:
    if "error" in row or "skipped" in row:
        return row.get("error") or row["skipped"]
    decode = row.get("decode_error") or ", ".join(
        f"{row[key + '_tok_s']:.1f} tok/s{label}"
        for key, label in (("decode", ""), ("decode_pipelined", " pipelined"))
        if key + "_tok_s" in row
    )
    return (
        f"peak {row['peak_bytes'] / MIB:.1f} MiB, KV {row['kv_bytes'] / MIB:.1f} MiB, "
        f"workspace {row['workspace_bytes'] / MIB:.1f} MiB, "
        f"prefill {row['prefill_tok_s']:.0f} tok/s, decode {decode}"
    )


def warm_up(setup: Setup, schemes: list[Scheme], tokens: int):
    """Run every scheme once at a small context, untimed (CUDA compiles its
    kernels at first use)."""
    errors = {}
    opts = setup.options
    references = dict(setup.references)
    saved = opts.decode_warmup, opts.decode_tokens
    opts.decode_warmup, opts.decode_tokens = 0, 2
    try:
        for scheme in schemes:
            tic = time.perf_counter()
            try:
                run_case(setup, scheme, tokens)
            except Exception as e:  # noqa: BLE001 (recorded, as in the run)
                errors[scheme.name] = f"{type(e).__name__}: {e}"
            log(f"bench: warm-up {scheme.name}: {time.perf_counter() - tic:.1f} s")
            gc.collect()
            mx.clear_cache()
    finally:
        opts.decode_warmup, opts.decode_tokens = saved
        setup.references = references
    return errors


def device_bandwidth_gbs(info: dict) -> float | None:
    """Datasheet memory bandwidth of the GPUs we run on, in GB/s."""
    name = str(info.get("device_name", info.get("name", "")))
    for gpu, gbs in (("H100", 3350.0), ("H200", 4800.0)):
        if gpu in name:
            return gbs
    return None


def device_info() -> dict:
    info = {"default_device": str(mx.default_device())}
    try:
        info.update({k: str(v) for k, v in mx.device_info().items()})
    except AttributeError as e:  # older MLX
        info["device_info_error"] = str(e)
    return info


def versions() -> dict:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "mlx": mx.__version__,
        "mlx_lm_patched": mlx_lm.__version__,
        "mlx_lm_patched_path": str(Path(mlx_lm.__file__).parent),
        "mlx_lm_patched_commit": patched_commit(),
        "mlx_lm_pristine": pristine_version(),
        "git": git_head(REPO_ROOT),
    }


def patched_commit() -> str | None:
    """The vendored repo's commit, or that named in a ``COMMIT`` file beside
    the package (a snapshot taken with ``git archive``)."""
    root = Path(mlx_lm.__file__).resolve().parents[1]
    if (root / "COMMIT").exists():
        return (root / "COMMIT").read_text().strip()
    return git_head(root)


def git_head(root: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write_json(path, report: dict):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, path)


def bench(options: argparse.Namespace) -> dict:
    """Build the models, run every case and return the report."""
    from mlx_lm.models import base

    tiles = setting(base, "QUANTIZED_SDPA_TILE_SCORES", options.tile_scores)
    with page_size(options.page_size), tiles:
        return run_bench(options)


def run_bench(options: argparse.Namespace) -> dict:
    preset = PRESETS[options.preset]
    dtype = getattr(mx, options.dtype or preset["dtype"])
    info = device_info()
    if options.bandwidth_gbs is None:
        options.bandwidth_gbs = device_bandwidth_gbs(info)
    schemes = [parse_scheme(s) for s in options.schemes]
    sweep = [parse_scheme(s) for s in options.sweep_schemes]

    log(f"bench: building {options.preset} ({dtype}) on {info['default_device']}")
    tic = time.perf_counter()
    ours, upstream = build_models(preset, dtype)
    _, upstream_cache = import_pristine()
    gc.collect()
    mx.clear_cache()
    weights = mx.get_active_memory()
    log(f"bench: weights {weights / GIB:.3f} GiB in {time.perf_counter() - tic:.1f} s")
    setup = Setup(ours, upstream, upstream_cache, options, weights)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": info,
        "versions": versions(),
        "args": {k: v for k, v in vars(options).items()},
        "preset": {"name": options.preset, **preset, "dtype": str(dtype)},
        "weights_bytes": weights,
        "default_page_size": QuantizedKVCache.page_size,
        "tile_scores": tile_scores(),
        "rows": [],
        "running": None,
    }
    if options.probe:
        report["probe"] = probe()
    runner = Runner(setup, report)
    # upstream's quantized attention can fail, or hang, on CUDA: it runs last
    ours = sorted((s for s in schemes if s.kind != "upstream"), key=lambda s: s.kind)
    runner.grid(ours, options.contexts)
    runner.sweep(sweep, options.sweep_context)
    runner.grid([s for s in schemes if s.kind == "upstream"], options.contexts)
    return report


def tile_scores() -> int:
    """Scores per attention tile in the patched tree."""
    from mlx_lm.models import base

    return base.quantized_sdpa_tile_scores()


# --- reporting -----------------------------------------------------------------


def ok(row: dict | None, key: str = "peak_bytes") -> bool:
    """Whether ``row`` measured ``key`` (its decode may have failed alone)."""
    return row is not None and key in row


def row_fill(row: dict) -> tuple[str, int | None]:
    """How the row's cache was filled: the fill and its step in tokens."""
    return row.get("fill", "prefill"), row.get("prefill_step")


def row_key(row: dict) -> tuple:
    return row["context"], row["scheme"], *row_fill(row)


def find(rows, context, scheme, fill="prefill", step=None):
    """The row of (context, scheme) filled so (any step when ``step`` is None)."""
    for row in rows:
        row_fill_, row_step = row_fill(row)
        if (row["context"], row["scheme"], row_fill_) != (context, scheme, fill):
            continue
        if step is None or row_step == step:
            return row
    return None


def ratio(row, other, key) -> str:
    if not (ok(row, key) and ok(other, key)) or not other[key]:
        return "—"
    return f"{row[key] / other[key]:.2f}"


def memory_unit(rows) -> tuple[str, int]:
    peaks = [r["peak_bytes"] for r in rows if ok(r)]
    return ("GiB", GIB) if peaks and max(peaks) >= GIB else ("MiB", MIB)


def markdown_table(rows: list[dict], weights_bytes: int, everything=None) -> list[str]:
    """One line per (context, scheme); ratios against fp16 and against the
    upstream counterpart at the same context (found in ``everything``)."""
    everything = everything or rows
    unit, scale = memory_unit(rows)
    lines = [
        (
            f"| context | scheme | weights {unit} | KV {unit} (nbytes) | peak {unit} "
            f"| workspace {unit} | prefill tok/s | decode tok/s | peak / fp16 "
            "| peak / upstream | decode / fp16 | decode / upstream "
            "| pipelined decode tok/s | pipelined / fp16 "
            "| pipelined tok/s, all steps | all steps / fp16 "
            "| logits err (prefill, decode) |"
        ),
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        head = f"| {row['context']} | {row['scheme']} | {weights_bytes / scale:.3f} |"
        if not ok(row):
            note = (row.get("error") or row.get("skipped", "")).replace("|", "/")
            lines.append(f"{head} {note[:120]} |" + " |" * 13)
            continue
        fill, step = row_fill(row)
        counterpart = parse_scheme(row["scheme"]).counterpart
        fp = find(everything, row["context"], "fp16", fill, step)
        up = find(everything, row["context"], counterpart, fill, step)
        missing = "error" if "decode_error" in row else "—"
        decode, pipelined, pipelined_mean = (
            f"{row[key]:.1f}" if ok(row, key) else missing
            for key in (
                "decode_tok_s",
                "decode_pipelined_tok_s",
                "decode_pipelined_tok_s_mean",
            )
        )
        errors = [row.get(f"{k}_logits_rel_err") for k in ("prefill", "decode")]
        errors = ", ".join("—" if e is None else f"{e:.3g}" for e in errors)
        lines.append(
            f"{head} {row['kv_bytes'] / scale:.3f} | {row['peak_bytes'] / scale:.3f} "
            f"| {row['workspace_bytes'] / scale:.3f} | {row['prefill_tok_s']:.0f} "
            f"| {decode} | {ratio(row, fp, 'peak_bytes')} "
            f"| {ratio(row, up, 'peak_bytes')} | {ratio(row, fp, 'decode_tok_s')} "
            f"| {ratio(row, up, 'decode_tok_s')} | {pipelined} "
            f"| {ratio(row, fp, 'decode_pipelined_tok_s')} | {pipelined_mean} "
            f"| {ratio(row, fp, 'decode_pipelined_tok_s_mean')} | {errors} |"
        )
    return lines


def floor_table(rows: list[dict]) -> list[str]:
    """Decode time against the bytes every step reads over the bandwidth."""
    rows = [r for r in rows if ok(r) and "floor_ms" in r]
    rows = [
        r for r in rows if "decode_ms_median" in r or "decode_pipelined_ms_median" in r
    ]
    if not rows:
        return []
    lines = [
        (
            "| context | scheme | fill, step | decode ms | pipelined decode ms "
            "| KV floor ms | weights + KV floor ms | decode / floor |"
        ),
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fill = "{}, {}".format(*row_fill(r))
        sync, pipelined = (
            r.get(f"{key}_ms_median") for key in ("decode", "decode_pipelined")
        )
        best = min(t for t in (sync, pipelined) if t is not None)
        sync, pipelined = ("—" if t is None else f"{t:.2f}" for t in (sync, pipelined))
        lines.append(
            f"| {r['context']} | {r['scheme']} | {fill} | {sync} | {pipelined} "
            f"| {r['kv_floor_ms']:.3f} | {r['floor_ms']:.3f} "
            f"| {best / r['floor_ms']:.2f} |"
        )
    return lines


FILLS = {
    "prefill": "chunked prefill",
    "synthetic": "synthetic fill (random keys and values written to the cache, "
    "no prefill attention: decode speed only)",
}


def report_markdown(report: dict) -> str:
    device = report["device"].get("device_name", report["device"]["default_device"])
    preset = report["preset"]
    lines = [
        f"bench {preset['name']} ({preset['dtype']}) on {device}, "
        + f"{report['date']}, mlx {report['versions']['mlx']}"
    ]
    batch = report["args"].get("batch", 1)
    if batch > 1:
        padding = left_padding(batch)
        note = (
            f"{batch} sequences per step, left-padded by {padding} tokens (mlx-lm's "
            "batch caches); prefill and decode tokens/s summed over them (padding "
            "included), decode ms per step"
        )
        lines += ["", note]
    for fill, step in sorted({row_fill(r) for r in report["rows"]}, key=str):
        rows = [r for r in report["rows"] if row_fill(r) == (fill, step)]
        lines += ["", f"Cache filled by {FILLS[fill]}, {step}-token steps", ""]
        lines += fill_tables(rows, report["weights_bytes"])
    floors = floor_table(report["rows"])
    if floors:
        lines += ["", f"Bandwidth floor ({report['args']['bandwidth_gbs']:g} GB/s)", ""]
        lines += floors
    return "\n".join(lines)


def fill_tables(rows: list[dict], weights_bytes: int) -> list[str]:
    """The grid, then the page-size sweep with the grid's rows at its context."""
    grid = [r for r in rows if not r["sweep"]]
    sweep = [r for r in rows if r["sweep"]]
    lines = markdown_table(grid, weights_bytes) if grid else []
    if sweep:
        context = sweep[0]["context"]
        same = [
            r
            for r in grid
            if r["context"] == context and parse_scheme(r["scheme"]).kind == "ours"
        ]
        lines += ["", f"Page-size sweep at {context} tokens", ""]
        lines += markdown_table(same + sweep, weights_bytes, rows)
    return lines


def plot(report: dict, plot_dir, prefix: str) -> list[str]:
    """Peak memory and decode speed against context, one line per scheme:
    ``{prefix}-peak.png``, ``{prefix}-decode.png`` and, for a synthetic fill,
    ``{prefix}-decode-synthetic.png``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("bench: matplotlib is missing: no plots")
        return []
    device = report["device"].get("device_name", report["device"]["default_device"])
    title = f"{report['preset']['name']} ({report['preset']['dtype']}), {device}"
    rows = [r for r in report["rows"] if ok(r) and not r["sweep"]]
    prefilled = [r for r in rows if r.get("fill", "prefill") == "prefill"]
    synthetic = [r for r in rows if r.get("fill") == "synthetic"]
    plots = (
        (prefilled, "peak_bytes", "peak memory during prefill (GiB)", GIB, "peak"),
        (prefilled, "decode_tok_s", "decode tokens/s", 1, "decode"),
        (
            synthetic,
            "decode_tok_s",
            "decode tokens/s (synthetic fill)",
            1,
            "decode-synthetic",
        ),
    )
    paths = []
    for selected, key, label, scale, name in plots:
        selected = [r for r in selected if key in r]
        if not selected:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        steps = {r.get("prefill_step") for r in selected}
        for line in dict.fromkeys(
            (r["scheme"], r.get("prefill_step")) for r in selected
        ):
            points = [
                (r["context"], r[key] / scale)
                for r in selected
                if (r["scheme"], r.get("prefill_step")) == line
            ]
            label_ = line[0] if len(steps) < 2 else f"{line[0]}, step {line[1]}"
            ax.plot(*zip(*points), marker="o", label=label_)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        path = Path(plot_dir) / f"{prefix}-{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths


def merge(paths: list[str]) -> dict:
    """Join the rows of several runs (later files win) under the first's
    metadata."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    merged = dict(reports[0])
    rows = {}
    for report in reports:
        for row in report["rows"]:
            # a case its run's deadline skipped measured nothing
            if "deadline" in row.get("skipped", ""):
                continue
            row.setdefault("fill", report["args"].get("fill", "prefill"))
            row.setdefault("prefill_step", report["args"]["prefill_step"])
            rows[row_key(row)] = row
        for key in ("probe", "warmup_errors"):
            if key in report and key not in merged:
                merged[key] = report[key]
    merged["rows"] = sorted(
        rows.values(), key=lambda r: (r.get("fill", ""), r["sweep"], r["context"])
    )
    merged["merged_from"] = [
        {"file": Path(p).name, "date": r["date"], "args": r["args"]}
        for p, r in zip(paths, reports)
    ]
    return merged


# --- command line ----------------------------------------------------------------


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m omlx_cache.bench",
        description="Peak memory and decode speed of KV cache schemes, "
        "ours and upstream mlx-lm's, in one process.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny-cpu")
    parser.add_argument(
        "--contexts", type=int_list, help="comma-separated (default: the preset's)"
    )
    parser.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES))
    parser.add_argument("--decode-tokens", type=int, default=16, help="timed steps")
    parser.add_argument("--decode-warmup", type=int, default=3, help="untimed steps")
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="sequences decoded together, with left padding, in mlx-lm's batch "
        "caches (fp16 and our schemes); tokens/s are summed over them",
    )
    parser.add_argument(
        "--decode-mode",
        choices=sorted(DECODE_MODES),
        default="both",
        help="sync: evaluate each step before building the next; pipelined: queue "
        "the next step first, as generate_step does (default: both, in that order)",
    )
    parser.add_argument("--prefill-step", type=int, default=2048)
    parser.add_argument(
        "--fill",
        choices=("prefill", "synthetic"),
        default="prefill",
        help="fill the cache by chunked prefill, or with random keys and values "
        "(decode speed only: no prefill attention, no logits after the fill)",
    )
    parser.add_argument("--dtype", help="activations (default: the preset's)")
    parser.add_argument("--kv-group-size", type=int, default=64)
    parser.add_argument("--page-size", type=int, help="QuantizedKVCache.page_size")
    parser.add_argument(
        "--tile-scores",
        type=int,
        help="base.QUANTIZED_SDPA_TILE_SCORES: scores per attention tile "
        "(default: the device's, 2^24, or 2^26 on CUDA)",
    )
    parser.add_argument(
        "--sweep-schemes",
        nargs="*",
        default=[],
        help="schemes run at --sweep-context only, e.g. 4/p1024 4/p16384 4+reserve",
    )
    parser.add_argument("--sweep-context", type=int, default=32768)
    parser.add_argument(
        "--warmup", type=int, default=0, help="run each scheme untimed at this context"
    )
    parser.add_argument(
        "--case-budget", type=float, default=0, help="seconds per case (0: none)"
    )
    parser.add_argument(
        "--case-timeout",
        type=float,
        default=0,
        help="end the process when one case runs this long (a hung kernel)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=0,
        help="skip the cases that start later than this many seconds into the run",
    )
    parser.add_argument(
        "--bandwidth-gbs", type=float, help="default: H100/H200 datasheet"
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="first try the attention's quantized matmuls at an 8B model's shapes",
    )
    parser.add_argument("--out", help="JSON file (rewritten after every case)")
    parser.add_argument("--plot-dir")
    parser.add_argument("--plot-prefix", default="bench")
    parser.add_argument(
        "--merge", nargs="+", help="join these JSON files instead of running"
    )
    options = parser.parse_args(argv)
    if options.contexts is None:
        options.contexts = list(PRESETS[options.preset]["contexts"])
    return options


def main(argv=None):
    options = parse_args(argv)
    if options.merge:
        report = merge(options.merge)
    else:
        report = bench(options)
    if options.out:
        write_json(options.out, report)
    if options.plot_dir:
        for path in plot(report, options.plot_dir, options.plot_prefix):
            log(f"bench: wrote {path}")
    print(report_markdown(report))


if __name__ == "__main__":
    main()
