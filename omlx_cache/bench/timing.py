"""One measurement: fill a cache (chunked prefill or synthetic), then time
single-token decode steps synchronously and pipelined (as ``generate_step``
runs them); the peak memory, cache bytes and logits errors of the case."""

import argparse
import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..kv.store import KVStore
from .caches import (
    Scheme,
    converter,
    make_cache,
)
from .common import log
from .models import lm_head


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
        page_size=KVStore.page_size if scheme.kind == "ours" else None,
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
                times, first = decode(model, cache, sync_steps, after_call, deadline)
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


def case_row(scheme: Scheme, context: int, sweep: bool, opts) -> dict:
    return {
        "context": context,
        "scheme": scheme.name,
        "sweep": sweep,
        "fill": opts.fill,
        "prefill_step": opts.prefill_step,
        "batch": opts.batch,
    }
