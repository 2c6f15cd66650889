"""KV cache quality: perplexity, KL divergence and top-1 agreement against fp16 KV.

    python -m omlx_cache.eval --model models/SmolLM2-135M-Instruct-f32 \\
        --kv fp16 --kv 8 --kv 8,4 --kv 4 --out docs/data/eval-smollm2.json

The text is split into consecutive windows, each BOS and the next C - 1 tokens.
For every window and scheme a fresh cache is made and the window is fed
through the model in chunks, so later tokens attend the keys and values as the
cache stores them, exactly as in generation. Every next token after the first
is scored. The reference scheme (``fp16``, a plain cache) always runs first;
the others are compared with it token by token.

``--passkey 4096,8192`` adds a retrieval test per scheme: a five-digit key
hidden at ``--passkey-depths`` depths of a filler text of that many tokens
(``--passkey-keys`` keys per depth), asked for at the end (``passkey_prompt``);
a trial succeeds when greedy decoding through the scheme's cache gives every
token of the key. Each scheme's trials are paired with the reference's on the
same prompts: keys lost and gained, and McNemar's exact p-value.
``--dtype`` casts the model (and so the reference cache) to the dtype users
run, e.g. bfloat16.
"""

import argparse
import hashlib
import json
import math
import os
import platform
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from random import Random

import mlx.core as mx
import numpy as np
from mlx import nn

from . import __version__, fit
from .kv.spec import AVERAGE_CONTEXT, KVSpec, layer_shapes, preset_help
from .measure import (  # noqa: F401 (the eval's own API too)
    Progress,
    format_seconds,
    model_dtype,
    token_stats,
    window_logprobs,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct-f32"
DEFAULT_TEXT = REPO_ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
DEFAULT_SCHEMES = ("fp16", "8", "8,4", "4")
REFERENCE = "fp16"
Z95 = 1.959963984540054


# ---------------------------------------------------------------------------
# Text


def read_text(path) -> str:
    """The evaluation text with ``\\r\\n`` line ends normalized to ``\\n``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"Evaluation text not found: {path}. Pass --text PATH (the default is "
            "../shared/data/wikitext-2-raw/wiki.test.raw beside the checkout)."
        )
    return path.read_text(encoding="utf-8").replace("\r\n", "\n")


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens."""
    from transformers.utils import logging as hf_logging

    # the whole text is longer than the model's context; we only cut windows
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    finally:
        hf_logging.set_verbosity(verbosity)


def make_windows(
    tokens: Sequence[int],
    num_windows: int,
    window_tokens: int,
    bos: int | None = None,
) -> mx.array:
    """Consecutive windows of ``window_tokens`` tokens, shape (num_windows,
    window_tokens): BOS and the next ``window_tokens - 1`` tokens of the text,
    or ``window_tokens`` tokens of the text when there is no BOS."""
    if window_tokens < 2:
        raise ValueError("A window needs at least 2 tokens.")
    body = window_tokens - (bos is not None)
    needed = num_windows * body
    if len(tokens) < needed:
        raise ValueError(
            f"The text has {len(tokens)} tokens; {num_windows} windows of "
            f"{window_tokens} tokens need {needed}."
        )
    windows = np.asarray(tokens[:needed], dtype=np.int32).reshape(num_windows, body)
    if bos is not None:
        column = np.full((num_windows, 1), bos, dtype=np.int32)
        windows = np.concatenate([column, windows], axis=1)
    return mx.array(windows)


# ---------------------------------------------------------------------------
# One window through one cache


# ---------------------------------------------------------------------------
# All windows through all schemes


@dataclass(frozen=True)
class Scheme:
    """A scheme as a run uses it: its spec (fitted to the model) and the
    bounded context every layer gets, if any (``--max-kv-size``)."""

    spec: KVSpec
    max_kv_size: int | None = None

    @property
    def name(self) -> str:
        bound = f" @ max-kv-size {self.max_kv_size}" if self.max_kv_size else ""
        return f"{self.spec}{bound}"

    @property
    def is_reference(self) -> bool:
        return self.spec.is_reference

    def make_cache(self, model) -> list:
        return self.spec.make_cache(model, self.max_kv_size)


@dataclass
class SchemeRun:
    scheme: Scheme
    nll: list[np.ndarray] = field(default_factory=list)
    kld: list[np.ndarray] = field(default_factory=list)
    top1: list[np.ndarray] = field(default_factory=list)
    seconds: float = 0.0
    # bytes the caches had allocated at the end of a window
    allocated_bytes: int = 0

    def add(self, stats, seconds: float, allocated_bytes: int):
        for values, x in zip((self.nll, self.kld, self.top1), stats):
            values.append(x)
        self.seconds += seconds
        self.allocated_bytes = allocated_bytes


def evaluate_tokens(
    model: nn.Module,
    windows: mx.array,
    schemes: Sequence[Scheme],
    chunk: int = 128,
    seed: int = 0,
    progress: Progress | None = None,
) -> list[dict]:
    """Score every window under every scheme; ``schemes[0]`` is the reference
    the others are compared with. Returns one summary dict per scheme."""
    runs = [SchemeRun(scheme) for scheme in schemes]
    shapes = layer_shapes(model, schemes[0].max_kv_size)
    for w, tokens in enumerate(windows):
        reference = None
        for run in runs:
            if progress is not None:
                progress.label = f"window {w + 1}, kv {run.scheme.name}"
            mx.random.seed(seed)
            cache = run.scheme.make_cache(model)
            tic = time.perf_counter()
            on_chunk = progress.step if progress is not None else None
            logprobs = window_logprobs(model, tokens, cache, chunk, on_chunk)
            seconds = time.perf_counter() - tic
            if reference is None:
                reference = logprobs
            stats = token_stats(logprobs, tokens[1:], reference)
            run.add(stats, seconds, sum(c.nbytes for c in cache))
            del cache, logprobs
    # the caches hold every token of a window but its last
    held = windows.shape[1] - 1
    return [summarize(run, runs[0], shapes, held) for run in runs]


# ---------------------------------------------------------------------------
# Passkey retrieval (Mohtashami and Jaggi, 2023)

PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important "
    "information there.\n"
)
PASSKEY_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. "
    "Here we go. There and back again.\n"
)
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
PASSKEY_QUESTION = "What is the pass key? The pass key is"
# tokens a greedy answer may take past the key's own before it holds the key
PASSKEY_SLACK = 8


@dataclass
class PasskeyPrompt:
    tokens: list[int]
    # the key's tokens as they follow the question
    answer: list[int]
    key: str
    # where the needle is: 0 before all the filler, 1 after it
    depth: float
    # the positions in ``answer`` of the tokens that hold the key's digits
    # (Gemma's answer starts with a bare space, which holds none)
    digits: tuple[int, ...] = ()


def passkey_depths(n: int) -> list[float]:
    """``n`` depths from 0 to 1, evenly spaced."""
    if n < 1:
        raise ValueError(f"Passkey depths must be 1 or more, got {n}.")
    return [0.0] if n == 1 else [i / (n - 1) for i in range(n)]


def passkey_key(context: int, trial: int, seed: int = 0) -> str:
    """A five-digit key, the same for the same context, trial and seed."""
    return str(Random(f"{seed}-{context}-{trial}").randint(10000, 99999))


def passkey_prompt(
    tokenizer, context: int, depth: float, key: str, bos: int | None = None
) -> PasskeyPrompt:
    """The introduction, as many filler lines as fit in ``context`` tokens
    (the answer included) with the needle after ``depth`` of them, and the
    question; BOS first when given."""
    question = encode(tokenizer, PASSKEY_QUESTION)
    answer = answer_tokens(tokenizer, key)
    intro = ([] if bos is None else [bos]) + encode(tokenizer, PASSKEY_INTRO)
    filler = encode(tokenizer, PASSKEY_FILLER)
    needle = encode(tokenizer, PASSKEY_NEEDLE.format(key=key))
    fixed = len(intro) + len(needle) + len(question) + len(answer)
    lines = (context - fixed) // len(filler)
    if lines < 1:
        raise ValueError(f"A passkey prompt needs more than {fixed} tokens.")
    before = round(depth * lines)
    tokens = intro + filler * before + needle + filler * (lines - before) + question
    return PasskeyPrompt(tokens, answer, key, depth, digit_positions(tokenizer, answer))


def answer_tokens(tokenizer, key: str) -> list[int]:
    """The key's tokens as they follow the question."""
    question = encode(tokenizer, PASSKEY_QUESTION)
    answer = encode(tokenizer, f"{PASSKEY_QUESTION} {key}")
    if answer[: len(question)] != question:
        raise ValueError("The tokenizer joins the passkey to the question.")
    return answer[len(question) :]


def digit_positions(tokenizer, tokens: list[int]) -> tuple[int, ...]:
    """The positions of the tokens that decode to text with a digit."""
    return tuple(
        i
        for i, t in enumerate(tokens)
        if any(c.isdigit() for c in tokenizer.decode([t]))
    )


def predicts_digits(predicted: list[int], answer: list[int], digits) -> bool:
    """Whether ``predicted`` has ``answer``'s tokens at the ``digits``
    positions: the key itself, whatever the tokens around it."""
    return all(predicted[i] == answer[i] for i in digits)


def digits_retrieved(tokenizer, trial: dict) -> bool:
    """A stored trial's ``digits`` (``passkey_trial``), from its predicted
    tokens: for runs stored before trials kept it."""
    answer = answer_tokens(tokenizer, trial["key"])
    positions = digit_positions(tokenizer, answer)
    return predicts_digits(trial["predicted"], answer, positions)


def passkey_prompts(
    tokenizer,
    context: int,
    depths: Sequence[float],
    keys: int = 1,
    seed: int = 0,
    bos: int | None = None,
) -> list[PasskeyPrompt]:
    """The prompts of ``keys`` passkeys at each of ``depths``, in trial order:
    key ``k`` at depth ``i`` is trial ``k * len(depths) + i``."""
    return [
        passkey_prompt(
            tokenizer,
            context,
            depth,
            passkey_key(context, k * len(depths) + i, seed),
            bos,
        )
        for k in range(keys)
        for i, depth in enumerate(depths)
    ]


def prefill(model, tokens: list[int], cache: list, chunk: int) -> mx.array:
    """The last position's logits after ``tokens`` go through ``cache`` in
    chunks of ``chunk``."""
    tokens = mx.array(tokens)
    starts = range(0, tokens.size, chunk)
    for start in starts[:-1]:
        # the caches only, as generate_step prefills: the logits of every
        # position of a chunk (a 262K vocabulary on Gemma) are not needed
        model(tokens[None, start : start + chunk], cache=cache)
        mx.eval([c.state for c in cache])
    return model(tokens[None, starts[-1] :], cache=cache)[0, -1]


def passkey_trial(model, prompt: PasskeyPrompt, cache: list, chunk: int) -> dict:
    """Prefill ``prompt`` through ``cache`` in chunks and decode greedily, one
    token at a time, as many tokens as the key has, each step fed the key's
    token (so the steps after a wrong one still say how far off it is)."""
    logits = prefill(model, prompt.tokens, cache, chunk)
    predicted, logprob = [], 0.0
    for i, target in enumerate(prompt.answer):
        if i:
            logits = model(mx.array([[prompt.answer[i - 1]]]), cache=cache)[0, -1]
        logits = logits.astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits)
        predicted.append(int(mx.argmax(logprobs).item()))
        logprob += logprobs[target].item()
    return {
        "depth": prompt.depth,
        "key": prompt.key,
        "tokens": len(prompt.tokens) + len(prompt.answer),
        "correct": predicted == prompt.answer,
        "digits": predicts_digits(predicted, prompt.answer, prompt.digits),
        "predicted": predicted,
        "answer_logprob": logprob,
    }


def passkey_answer(
    model, prompt: PasskeyPrompt, cache: list, chunk: int, steps: int
) -> list[int]:
    """The ``steps`` tokens greedy decoding writes after ``prompt``, each step
    fed the token it chose."""
    logits = prefill(model, prompt.tokens, cache, chunk)
    answer = []
    for step in range(steps):
        if step:
            logits = model(mx.array([[answer[-1]]]), cache=cache)[0, -1]
        answer.append(int(mx.argmax(logits).item()))
    return answer


def answer_has_key(answer: str, key: str) -> bool:
    """Whether ``key`` stands in ``answer`` as a number of its own."""
    return re.search(rf"(?<!\d){re.escape(key)}(?!\d)", answer) is not None


def evaluate_passkey(
    model,
    tokenizer,
    schemes: Sequence[Scheme],
    contexts: Sequence[int],
    depths: Sequence[float],
    chunk: int = 512,
    seed: int = 0,
    bos: int | None = None,
    progress: Progress | None = None,
    keys: int = 1,
) -> list[dict]:
    """Per scheme, ``{context: {"correct", "found", "trials", "runs": [trial,
    ...]}}`` for ``keys`` passkeys at each of ``depths`` in prompts of
    ``contexts`` tokens: ``correct`` counts the trials that predict every
    token of the key (``passkey_trial``), ``found`` those whose greedy answer
    holds the key (a trial that is not correct decodes its ``answer`` again,
    from a fresh cache), ``digits`` those that predict the tokens holding the
    key's digits. The schemes after the first (the reference) also get
    ``"vs_reference"`` (``paired_outcomes``), ``"found_vs_reference"`` and
    ``"digits_vs_reference"`` (``mcnemar``)."""
    results = [{} for _ in schemes]
    for context in contexts:
        for prompt in passkey_prompts(tokenizer, context, depths, keys, seed, bos):
            for scheme, result in zip(schemes, results):
                if progress is not None:
                    progress.label = (
                        f"passkey {context}, depth {prompt.depth:.2f}, kv {scheme.name}"
                    )
                trial = passkey_trial(model, prompt, scheme.make_cache(model), chunk)
                if not trial["correct"]:
                    # what the model says, as its own greedy answer: a miss
                    # may be a first word (" the 80365") and the key after it
                    steps = len(prompt.answer) + PASSKEY_SLACK
                    cache = scheme.make_cache(model)
                    answer = passkey_answer(model, prompt, cache, chunk, steps)
                    trial["answer"] = tokenizer.decode(answer)
                trial["found"] = trial["correct"] or answer_has_key(
                    trial["answer"], prompt.key
                )
                runs = result.setdefault(str(context), {"runs": []})["runs"]
                runs.append(trial)
                if progress is not None:
                    progress.step()
    for result in results:
        for context, by_context in result.items():
            by_context["trials"] = len(by_context["runs"])
            by_context["correct"] = sum(t["correct"] for t in by_context["runs"])
            by_context["found"] = sum(t["found"] for t in by_context["runs"])
            by_context["digits"] = sum(t["digits"] for t in by_context["runs"])
            if result is not results[0]:
                reference = results[0][context]["runs"]
                runs = by_context["runs"]
                by_context["vs_reference"] = paired_outcomes(reference, runs)
                by_context["found_vs_reference"] = mcnemar(reference, runs, "found")
                by_context["digits_vs_reference"] = mcnemar(reference, runs, "digits")
    return results


def mcnemar(reference: Sequence[dict], runs: Sequence[dict], outcome: str) -> dict:
    """Trials whose ``outcome`` the reference has and the runs on the same
    prompts lack (``lost``), the other way round (``gained``), and the exact
    two-sided McNemar p-value of that difference (a binomial test on the
    trials that differ)."""
    lost = sum(r[outcome] and not t[outcome] for r, t in zip(reference, runs))
    gained = sum(t[outcome] and not r[outcome] for r, t in zip(reference, runs))
    n, low = lost + gained, min(lost, gained)
    tail = sum(math.comb(n, i) for i in range(low + 1)) / 2**n if n else 1.0
    return {"lost": lost, "gained": gained, "p": min(1.0, 2 * tail)}


def paired_outcomes(reference: Sequence[dict], runs: Sequence[dict]) -> dict:
    """How a scheme's passkey trials differ from the reference's on the same
    prompts: keys ``lost`` (the reference predicted all the key's tokens, the
    scheme did not), ``gained``, and their McNemar p (``mcnemar``). Trials
    that carry the key's log-probability (``passkey_trial``) add the mean
    paired difference of it and that mean's standard error,
    ``logprob_delta`` and ``logprob_delta_se``: a finer measure than found or
    not."""
    outcomes = mcnemar(reference, runs, "correct")
    pairs = [(r, t) for r, t in zip(reference, runs) if "answer_logprob" in r]
    if pairs and all("answer_logprob" in t for _, t in pairs):
        delta = np.array([t["answer_logprob"] - r["answer_logprob"] for r, t in pairs])
        se = delta.std(ddof=1) / math.sqrt(delta.size) if delta.size > 1 else 0.0
        outcomes.update(logprob_delta=float(delta.mean()), logprob_delta_se=float(se))
    return outcomes


# ---------------------------------------------------------------------------
# Statistics


def mean_ci(x: np.ndarray):
    """Mean and its normal 95% interval from the standard error."""
    x = np.asarray(x, dtype=np.float64)
    mean = float(x.mean())
    if x.size < 2:
        return mean, [mean, mean]
    half = Z95 * float(x.std(ddof=1)) / math.sqrt(x.size)
    return mean, [mean - half, mean + half]


def wilson_ci(successes: int, n: int):
    """Wilson 95% interval of a proportion (stays inside [0, 1])."""
    p = successes / n
    denom = 1 + Z95**2 / n
    center = (p + Z95**2 / (2 * n)) / denom
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / denom
    # at p = 0 or 1 one end is p itself; keep rounding from moving it past p
    return [min(center - half, p), max(center + half, p)]


def summarize(run: SchemeRun, reference: SchemeRun, shapes, window: int) -> dict:
    nll = np.concatenate(run.nll)
    diff = nll - np.concatenate(reference.nll)
    kld = np.concatenate(run.kld)
    agree = int(np.concatenate(run.top1).sum())
    n = nll.size

    mean_nll, nll_ci = mean_ci(nll)
    mean_diff, diff_ci = mean_ci(diff)
    mean_kld, kld_ci = mean_ci(kld)

    spec = run.scheme.spec
    footprints = {n: spec.footprint(shapes, n) for n in (window, AVERAGE_CONTEXT)}
    return {
        "kv": run.scheme.name,
        "spec": spec.text,
        "reference": run is reference,
        "ppl": math.exp(mean_nll),
        "ppl_ci": [math.exp(x) for x in nll_ci],
        "window_ppl": [math.exp(float(x.mean())) for x in run.nll],
        "delta_ppl_pct": 100 * math.expm1(mean_diff),
        "delta_ppl_pct_ci": [100 * math.expm1(x) for x in diff_ci],
        "kld": mean_kld,
        "kld_ci": kld_ci,
        "top1": 100 * agree / n,
        "top1_ci": [100 * x for x in wilson_ci(agree, n)],
        # everything a sequence of that many tokens stores, as a 16-bit model
        # stores it (KVSpec.footprint)
        "bits_per_element": footprints[AVERAGE_CONTEXT]["bits_per_element"],
        "bits_per_element_context": AVERAGE_CONTEXT,
        "cache_bytes_per_token": footprints[window]["bytes_per_token"],
        "kept_tokens": 0 if spec.is_reference else spec.first_tokens,
        "more_layers": list(spec.layers),
        "cache_allocated_bytes": run.allocated_bytes,
        "tokens": n,
        "seconds": run.seconds,
    }


# ---------------------------------------------------------------------------
# Report


def format_ci(ci, digits: int) -> str:
    return f"{ci[0]:.{digits}f}–{ci[1]:.{digits}f}"


def format_bits(r: dict) -> str:
    return f"{r['bits_per_element']:.3f}"


def format_row(r: dict) -> str:
    delta = (
        "ref"
        if r["reference"]
        else (f"{r['delta_ppl_pct']:+.2f}% ({format_ci(r['delta_ppl_pct_ci'], 2)})")
    )
    cells = [
        r["kv"],
        format_bits(r),
        f"{r['ppl']:.3f} ({format_ci(r['ppl_ci'], 2)})",
        delta,
        f"{r['kld']:.4f} ± {(r['kld_ci'][1] - r['kld_ci'][0]) / 2:.4f}",
        f"{r['top1']:.1f}% ({format_ci(r['top1_ci'], 1)})",
        f"{r['cache_bytes_per_token']:,.0f}",
        f"{r['seconds']:.1f}",
    ]
    return "| " + " | ".join(cells) + " |"


TABLE_HEADER = (
    "| KV | bits/elem | PPL (95% CI) | ΔPPL vs fp16 (95% CI) "
    "| KLD vs fp16 (± 95%) | top-1 = fp16 (95% CI) | KV bytes/token | s |\n"
    "|---|---|---|---|---|---|---|---|"
)

TABLE_NOTES = (
    f"bits/elem: everything a sequence of {AVERAGE_CONTEXT} tokens stores, keys and "
    "values, as a 16-bit model stores it (codes, scales and norms, the first tokens "
    "kept, a residual, the transform; bounded layers hold at most their window), "
    "from the scheme's spec. KV bytes/token: the same over all layers at the window's "
    "length. s: seconds of forward passes for the scheme, all windows."
)


def format_table(results: Sequence[dict]) -> str:
    rows = "\n".join(format_row(r) for r in results)
    return f"{TABLE_HEADER}\n{rows}\n\n{TABLE_NOTES}"


def format_passkey(r: dict) -> str:
    """``4096: 8/8, 8192: 7/8 (-2 +1), in answer 8/8 (-0 +0)`` from a
    result's passkey trials: keys whose every token greedy decoding predicts,
    then lost and gained against the reference's trials; then the keys its
    greedy answers hold (runs stored before that count lack it)."""
    parts = []
    for context, x in r.get("passkey", {}).items():
        part = f"{context}: {x['correct']}/{x['trials']}"
        if vs := x.get("vs_reference"):
            part += f" (-{vs['lost']} +{vs['gained']})"
        if "found" in x:
            part += f", in answer {x['found']}/{x['trials']}"
        if vs := x.get("found_vs_reference"):
            part += f" (-{vs['lost']} +{vs['gained']})"
        if "digits" in x:
            part += f", digits {x['digits']}/{x['trials']}"
        if vs := x.get("digits_vs_reference"):
            part += f" (-{vs['lost']} +{vs['gained']})"
        parts.append(part)
    return ", ".join(parts)


def summary_table(results: Sequence[dict]) -> str:
    """A short markdown table of a run: bits, ΔPPL, KLD, top-1 and passkey
    retrieval per scheme."""
    passkey = any("passkey" in r for r in results)
    lines = [
        "| KV | bits/elem | ΔPPL vs fp16 (95% CI) | KLD (± 95%) | top-1 (95% CI) |"
        + (" passkey |" if passkey else ""),
        "|---|---|---|---|---|" + ("---|" if passkey else ""),
    ]
    for r in results:
        delta = (
            f"ref (PPL {r['ppl']:.3f})"
            if r["reference"]
            else f"{r['delta_ppl_pct']:+.2f}% ({format_ci(r['delta_ppl_pct_ci'], 2)})"
        )
        kld = f"{r['kld']:.4f} ± {(r['kld_ci'][1] - r['kld_ci'][0]) / 2:.4f}"
        top1 = f"{r['top1']:.1f}% ({format_ci(r['top1_ci'], 1)})"
        lines.append(
            f"| {r['kv']} | {format_bits(r)} | {delta} | {kld} | {top1} |"
            + (f" {format_passkey(r)} |" if passkey else "")
        )
    return "\n".join(lines)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = f"mlx device {mx.default_device()}"
    if mx.default_device() == mx.gpu:
        try:
            name = mx.device_info().get("device_name", "")
        except (AttributeError, RuntimeError):  # an MLX without it
            name = ""
        device += f" {name}, float32 matmuls in {float32_matmuls()}"
    return (
        f"{platform.system()} {platform.machine()}, {cpu}, "
        f"{os.cpu_count()} CPUs, {device}"
    )


def float32_matmuls() -> str:
    """How MLX's GPU backends multiply float32 matrices: in TF32 (inputs
    rounded to a 10-bit mantissa) unless ``MLX_ENABLE_TF32=0``. On CUDA that
    moves Gemma's passkey counts by a few keys (docs/results.md)."""
    return "float32" if os.environ.get("MLX_ENABLE_TF32") == "0" else "TF32"


def source_tree(package) -> str | None:
    """``<commit> <subject>`` of the git checkout a package is imported from,
    with ``(modified)`` when it has uncommitted changes; outside git, the
    ``COMMIT`` file beside the package (a ``git archive`` snapshot's) with
    ``(snapshot)``, else None."""
    import subprocess

    root = Path(package.__file__).resolve().parents[1]
    if not (root / ".git").exists() and (root / "COMMIT").is_file():
        return (root / "COMMIT").read_text().strip() + " (snapshot)"

    def git(*args):
        command = ["git", "-C", str(root), *args]
        return subprocess.run(command, check=False, capture_output=True, text=True)

    try:
        head = git("log", "-1", "--format=%h %s")
    except OSError:
        return None
    if head.returncode != 0:
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no", ".").stdout.strip()
    return head.stdout.strip() + (" (modified)" if dirty else "")


def versions() -> dict:
    import mlx_lm

    return {
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "mlx_lm_tree": source_tree(mlx_lm),
        "omlx_cache": __version__,
        "python": platform.python_version(),
    }


def sha256_file(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ---------------------------------------------------------------------------
# Command line


def resolve_schemes(names: Sequence[str]) -> list[KVSpec]:
    """The specs for ``names``, the reference first (added if missing),
    duplicates dropped."""
    specs, seen = [], set()
    for name in names:
        spec = KVSpec.parse(name)
        if spec.text not in seen:
            seen.add(spec.text)
            specs.append(spec)
    references = [s for s in specs if s.is_reference] or [KVSpec.parse(REFERENCE)]
    rest = [s for s in specs if s is not references[0]]
    return [references[0], *rest]


def model_schemes(model, specs: Sequence[KVSpec], max_kv_size=None) -> list[Scheme]:
    """The specs as a run on ``model`` uses them (``fit=`` resolved)."""
    return [Scheme(fit.resolve(spec, model), max_kv_size) for spec in specs]


def check_schemes(model, schemes: Sequence[Scheme]):
    """Run two tokens through every scheme's cache, so that a scheme that
    does not fit the model (a group size the head dim does not divide, a
    layer it lacks) fails before the long runs rather than after them."""
    tokens = mx.array([[0, 0]])
    shapes = None
    for scheme in schemes:
        try:
            mx.eval(model(tokens, cache=scheme.make_cache(model)))
            if not scheme.is_reference:
                # a store would fit its codecs to the head dim: a measurement
                # is of the scheme it names
                shapes = shapes or layer_shapes(model, scheme.max_kv_size)
                fitted = scheme.spec.fitted_dims(shapes)
                if fitted:
                    raise ValueError("; ".join(fitted))
        except ValueError as e:
            raise ValueError(f"KV scheme {scheme.name!r} does not fit the model: {e}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m omlx_cache.eval",
        description="KV cache quality: PPL, KLD and top-1 agreement vs fp16 KV.",
    )
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory")
    parser.add_argument(
        "--kv",
        action="append",
        metavar="SCHEME",
        help="KV cache scheme, repeatable (default: "
        f"{' '.join(DEFAULT_SCHEMES)}): fp16, a preset or name=value items, "
        f"see omlx_cache.kv.spec. Presets: {preset_help()}",
    )
    parser.add_argument("--text", default=str(DEFAULT_TEXT), help="evaluation text")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument(
        "--window-tokens", type=int, default=512, help="tokens per window, BOS included"
    )
    parser.add_argument(
        "--chunk", type=int, default=128, help="tokens fed to the model at a time"
    )
    parser.add_argument("--out", help="write the results to this JSON file")
    parser.add_argument(
        "--table",
        metavar="JSON",
        help="print the short table of an earlier run's JSON and exit",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="cast the model to this dtype first (default: as stored); the "
        "reference cache then holds keys and values in it too",
    )
    parser.add_argument(
        "--passkey",
        type=parse_contexts,
        default=(),
        metavar="N[,N...]",
        help="also test passkey retrieval in prompts of these many tokens, e.g. 4096,8192",
    )
    parser.add_argument(
        "--passkey-depths",
        type=int,
        default=8,
        help="needle depths per passkey context, evenly from 0 to 1 (default 8)",
    )
    parser.add_argument(
        "--passkey-keys",
        type=int,
        default=1,
        help="passkeys per depth (default 1): more trials, so that a scheme's "
        "difference from the reference can be told from chance",
    )
    parser.add_argument(
        "--passkey-chunk",
        type=int,
        default=512,
        help="prefill step of the passkey prompts (default 512)",
    )
    parser.add_argument(
        "--max-kv-size",
        type=int,
        help="bounded context for every scheme, the reference too: rotating "
        "caches of this many tokens keeping the first 4 (as mlx_lm's --max-kv-size)",
    )
    args = parser.parse_args(argv)
    if args.passkey_keys < 1:
        parser.error(f"--passkey-keys must be 1 or more, got {args.passkey_keys}")
    try:
        args.specs = resolve_schemes(args.kv or DEFAULT_SCHEMES)
    except ValueError as e:
        parser.error(f"--kv: {e}")
    return args


DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def parse_contexts(text: str) -> tuple[int, ...]:
    """``"4096,8192"`` -> (4096, 8192)."""
    try:
        contexts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N[,N...], got {text!r}") from None
    if any(n < 1 for n in contexts):
        raise argparse.ArgumentTypeError(f"contexts must be positive, got {text!r}")
    return contexts


# Debian's libopenblas0-pthread; the mlx CPU wheel bundles the reference BLAS
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")


def blas_hint() -> str | None:
    """A hint to preload OpenBLAS when running on the CPU without it: the
    bundled reference BLAS makes float32 forward passes about 8x slower."""
    if mx.default_device() != mx.cpu or os.environ.get("LD_PRELOAD"):
        return None
    if OPENBLAS.exists():
        return f"hint: LD_PRELOAD={OPENBLAS} makes the CPU forward ~8x faster"
    return (
        "hint: mlx's CPU wheel uses the reference BLAS; with OpenBLAS preloaded "
        f"(apt-get install libopenblas0-pthread; LD_PRELOAD={OPENBLAS}) "
        "the CPU forward is ~8x faster"
    )


def load_model(path: str):
    from mlx_lm import load

    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"Model directory not found: {path} "
            "(build it with: python -m omlx_cache.models smollm2 --out models)."
        )
    return load(path)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.table:
        report = json.loads(Path(args.table).read_text())
        print(summary_table(report["results"]))
        return report
    text = read_text(args.text)
    model, tokenizer = load_model(args.model)
    if args.dtype:
        model.set_dtype(DTYPES[args.dtype])
    try:
        schemes = model_schemes(model, args.specs, args.max_kv_size)
        check_schemes(model, schemes)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    depths = passkey_depths(args.passkey_depths) if args.passkey else []
    # the code as imported now, whatever changes on disk during the run
    run_versions = versions()
    tokens = encode(tokenizer, text)
    windows = make_windows(
        tokens, args.windows, args.window_tokens, tokenizer.bos_token_id
    )

    if hint := blas_hint():
        print(hint, file=sys.stderr)
    chunks = math.ceil((args.window_tokens - 1) / args.chunk)
    trials = len(args.passkey) * len(depths) * args.passkey_keys
    progress = Progress((args.windows * chunks + trials) * len(schemes))
    tic = time.perf_counter()
    results = evaluate_tokens(model, windows, schemes, args.chunk, args.seed, progress)
    if args.passkey:
        passkey = evaluate_passkey(
            model,
            tokenizer,
            schemes,
            args.passkey,
            depths,
            args.passkey_chunk,
            args.seed,
            tokenizer.bos_token_id,
            progress,
            args.passkey_keys,
        )
        for r, p in zip(results, passkey):
            r["passkey"] = p
    progress.close()
    wall = time.perf_counter() - tic

    report = {
        "model": args.model,
        "text": args.text,
        "text_sha256": sha256_file(args.text),
        "windows": args.windows,
        "window_tokens": args.window_tokens,
        "bos": tokenizer.bos_token_id,
        "chunk": args.chunk,
        "seed": args.seed,
        "max_kv_size": args.max_kv_size,
        "dtype": args.dtype or model_dtype(model),
        "passkey_depths": depths,
        "passkey_keys": args.passkey_keys if args.passkey else None,
        "passkey_chunk": args.passkey_chunk if args.passkey else None,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "versions": run_versions,
        "wall_seconds": wall,
        "results": results,
    }
    print(format_table(results))
    if args.passkey:
        print("\n" + summary_table(results))
    print(f"\n{results[0]['tokens']} scored tokens, {wall:.0f} s.")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
