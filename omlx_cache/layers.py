"""Which layers to give more bits: a rule from a short calibration text.

    python -m omlx_cache.layers --model models/gemma-3-270m-f32 \\
        --kv 4+rotate+center+exact16 --top 1 --out docs/data/layers-gemma3.json

A scheme's error is not spread evenly over a model's layers (on Gemma-3-270M
the one global layer 11 holds a quarter of the 4-bit error). For each layer
alone, ``layer_errors`` stores that layer's keys and values as the scheme
does and every other layer unquantized, and measures the mean KL divergence
of the next-token distribution against fp16 KV on a calibration text (by
default windows of the evaluation text after the tokens ``omlx_cache.eval``
scores, so the two do not overlap). The layers with the largest errors are
the ones to store with more bits: the command prints the scheme with the
``top`` of them at ``--bits`` (``+k8@11``: keys of layer 11 at 8 bits;
``--part kv``: keys and values). ``--apply`` names the scheme the layers go
to when it is not the calibrated one (calibrate the keys alone with 16-bit
values, give the layers to the scheme with quantized values), and
``--budget`` takes as many of the ranked layers as keep that scheme within
so many bits per element (``schemes.average_bits`` at 4,096 tokens)::

    python -m omlx_cache.layers --model models/SmolLM2-135M-Instruct-f32 \\
        --kv codebook-4k-16v+center+qscale+exact8 \\
        --apply codebook-4+center+qscale+exact8 --bits 5 --budget 4.6

``--sampled N`` calibrates on N tokens the model samples itself instead
(``sampled_tokens``: no data). ``fitted_layers`` does that once per model
for a scheme named ``…+k5@fit4.6`` (the preset ``cq4``) when it makes its
caches, and keeps the list in ``fit_dir()``.
"""

import argparse
import hashlib
import json
import os
import sys
import time
import weakref
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from . import eval as kv_eval
from . import schemes as kv_schemes


def sampled_tokens(model, count: int = 512, seed: int = 0, progress=None):
    """``count`` tokens the model samples itself (temperature 1, fp16 KV)
    after one token drawn at random from its vocabulary: a calibration text
    that needs no data, the same on the CPU for a model, dtype and ``seed``
    (on CUDA two runs in bfloat16 sampled different text: its logits are not
    bit-reproducible). ``progress``: an ``eval.Progress`` stepped per token."""
    key = mx.random.key(seed)

    def next_key():
        nonlocal key
        key, use = mx.random.split(key)
        return use

    first = mx.random.randint(0, model.args.vocab_size, (1,), key=next_key())

    def sampler(logprobs):
        return mx.random.categorical(logprobs, key=next_key())

    tokens = [first.item()]
    for token, _ in generate_step(first, model, max_tokens=count - 1, sampler=sampler):
        tokens.append(int(token))
        if progress:
            progress.step()
    return mx.array(tokens)


def sampled_window(model, count: int, seed: int = 0) -> mx.array:
    """``sampled_tokens`` as one calibration window, shape (1, count), with a
    progress bar on stderr."""
    progress = kv_eval.Progress(count - 1)
    progress.label = "sampling"
    window = sampled_tokens(model, count, seed, progress)[None]
    progress.close()
    return window


def layer_errors(
    model, windows, scheme: kv_schemes.Scheme, chunk: int = 128, progress=None
):
    """Mean KLD against fp16 KV with ``scheme`` in one layer at a time, one
    value per layer, over ``windows``. ``progress``: an ``eval.Progress`` of
    (layers + 1) * windows passes, stepped after each."""

    def window_logprobs(tokens, cache, label):
        logprobs = kv_eval.window_logprobs(model, tokens, cache, chunk)
        if progress:
            progress.label = label
            progress.step()
        return logprobs

    references = [window_logprobs(w, make_prompt_cache(model), "fp16") for w in windows]
    num_layers = len(make_prompt_cache(model))
    errors = []
    for layer in range(num_layers):
        klds = []
        for tokens, reference in zip(windows, references):
            cache = make_prompt_cache(model)
            cache[layer] = scheme.make_cache(model)[layer]
            logprobs = window_logprobs(tokens, cache, f"layer {layer}")
            _, kld, _ = kv_eval.token_stats(logprobs, tokens[1:], reference)
            klds.append(kld)
        errors.append(sum(float(k.mean()) for k in klds) / len(klds))
    return errors


def top_layers(errors, top: int) -> list[int]:
    """The ``top`` layers with the largest errors, in layer order."""
    ranked = sorted(range(len(errors)), key=lambda i: -errors[i])
    return sorted(ranked[:top])


def scheme_bits(model, name: str, context: int = kv_eval.AVERAGE_CONTEXT):
    """Mean of the (key, value) bits per element ``name``'s caches store for
    a sequence of ``context`` tokens (``schemes.average_bits``), from caches
    that have seen a few tokens (a codebook cache learns its head dims);
    None for caches it cannot count."""
    cache = kv_schemes.get_scheme(name).make_cache(model)
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=cache))
    bits = kv_schemes.average_bits(cache, context)
    return None if bits is None else sum(bits) / 2


def check_budget(model, name: str, budget: float):
    """ValueError unless ``name`` alone fits in ``budget`` bits per element."""
    bits = scheme_bits(model, name)
    if bits is None:
        raise ValueError(f"{name}: its caches have no bits per element to budget.")
    if bits > budget:
        raise ValueError(
            f"{name} alone stores {bits:.3f} bits, over --budget {budget}."
        )


def layers_within(model, errors, name: str, bits: int, part: str, budget: float):
    """The most of the layers ranked by ``errors`` that, at ``bits``, keep
    ``name`` (which ``check_budget`` passed) within ``budget`` bits per
    element (``scheme_bits``), in layer order."""

    def fits(n):
        layers = top_layers(errors, n)
        return scheme_bits(model, with_layers(name, layers, bits, part)) <= budget

    low, high = 0, len(errors)  # fits(low); the largest n that fits is in low..high
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return top_layers(errors, low)


# Layers fitted by ``fitted_layers``: in memory per model, and on disk
SAMPLED_TOKENS = 512
# 2: codebook schemes hold only their window in sliding layers (fewer bits)
FIT_VERSION = 2
_fitted = {}  # id(model): (a weak reference to it, {settings: layers})


def _known_fits(model) -> dict:
    entry = _fitted.get(id(model))
    if entry is None or entry[0]() is not model:
        entry = _fitted[id(model)] = (weakref.ref(model), {})
    return entry[1]


def fit_dir() -> Path:
    """Where fitted layer lists are kept: ``$OMLX_CACHE_HOME/layers``, by
    default ``~/.cache/omlx-cache/layers``."""
    root = os.environ.get("OMLX_CACHE_HOME") or Path.home() / ".cache" / "omlx-cache"
    return Path(root) / "layers"


def model_fingerprint(model) -> str:
    """A digest of the model's parameters: names, shapes, types and the first
    values of each."""
    digest = hashlib.sha256()
    for name, x in tree_flatten(model.parameters()):
        digest.update(f"{name} {x.shape} {x.dtype}".encode())
        digest.update(np.array(x.reshape(-1)[:64].astype(mx.float32)).tobytes())
    return digest.hexdigest()


def _read_fit(path: Path):
    """The layers stored at ``path``, or None where there is no readable list."""
    try:
        layers = json.loads(path.read_text())["layers"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(
            f"omlx_cache.layers: ignoring {path} ({e}); fitting again", file=sys.stderr
        )
        return None
    if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
        print(f"omlx_cache.layers: ignoring {path} (no layer list)", file=sys.stderr)
        return None
    return layers


def _write_fit(path: Path, report: dict):
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_suffix(f".{os.getpid()}.tmp")
        temp.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(temp, path)
    except OSError as e:
        print(
            f"omlx_cache.layers: cannot keep the fit in {path} ({e})", file=sys.stderr
        )


def fit_tokens(model) -> int:
    """``SAMPLED_TOKENS``, or a model's shortest sliding window if shorter: a
    layer measured alone holds the whole text, and its window mask must match
    the rotating caches beside it, which then hold it all too."""
    windows = [w for w in kv_schemes.layer_windows(model) if w is not None]
    return min([SAMPLED_TOKENS, *windows])


def fitted_layers(model, name: str, measure: str, bits: int, part: str, budget: float):
    """The layers that ``name`` gives ``bits`` (``part``) within ``budget``
    bits per element (``layers_within``), ranked by ``measure``'s per-layer
    error on ``SAMPLED_TOKENS`` tokens the model samples itself: no data, and
    one fit per model, kept in memory and in ``fit_dir()`` (fewer tokens for
    a model with shorter sliding windows: ``fit_tokens``). ValueError when
    ``name`` alone is over the budget."""
    settings = {
        "name": name,
        "measure": measure,
        "bits": bits,
        "part": part,
        "budget": budget,
        "dtype": kv_eval.model_dtype(model),
        "version": FIT_VERSION,
    }
    # every cache the scheme makes asks: a fit known in memory costs no more
    known = _known_fits(model)
    memo = json.dumps(settings, sort_keys=True)
    if memo in known:
        return known[memo]
    settings["sampled"] = fit_tokens(model)
    key = json.dumps(settings, sort_keys=True)
    digest = hashlib.sha256((model_fingerprint(model) + key).encode()).hexdigest()
    path = fit_dir() / f"{digest[:32]}.json"
    layers = _read_fit(path)
    if layers is None:
        check_budget(model, name, budget)
        tic = time.perf_counter()
        num_layers = len(make_prompt_cache(model))
        count = settings["sampled"]
        print(
            f"omlx_cache.layers: fitting {name} to {budget} bits per element "
            f"(once per model: {count} sampled tokens, "
            f"{num_layers + 1} passes over them)",
            file=sys.stderr,
        )
        windows = sampled_window(model, count)
        progress = kv_eval.Progress(num_layers + 1)
        measured = kv_schemes.get_scheme(measure)
        errors = layer_errors(model, windows, measured, 128, progress)
        progress.close()
        layers = layers_within(model, errors, name, bits, part, budget)
        report = dict(settings, layer_kld=errors, layers=layers)
        report["scheme"] = with_layers(name, layers, bits, part)
        report["seconds"] = time.perf_counter() - tic
        _write_fit(path, report)
        print(f"omlx_cache.layers: {report['scheme']} ({path})", file=sys.stderr)
    known[memo] = layers
    return layers


def with_layers(name: str, layers, bits: int, part: str = "k") -> str:
    """``name`` with ``layers`` at ``bits`` (``+k8@11.19``)."""
    if not layers:
        return name
    suffix = f"+{part}{bits}@{'.'.join(map(str, layers))}"
    head, slash, groups = name.partition("/")
    # before a codebook scheme's +vB@ values
    head, plus_v, values = head.partition("+v")
    return head + suffix + plus_v + values + slash + groups


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m omlx_cache.layers",
        description="Per-layer error of a KV cache scheme; which layers to give more bits.",
    )
    parser.add_argument("--model", default=str(kv_eval.DEFAULT_MODEL))
    parser.add_argument("--kv", required=True, metavar="SCHEME", help="base scheme")
    parser.add_argument("--text", default=str(kv_eval.DEFAULT_TEXT))
    parser.add_argument(
        "--skip",
        type=int,
        default=100_000,
        help="tokens of the text skipped first (default 100000: past what "
        "omlx_cache.eval scores)",
    )
    parser.add_argument(
        "--sampled",
        type=int,
        metavar="N",
        help="calibrate on N tokens the model samples itself (sampled_tokens) "
        "instead of --text",
    )
    parser.add_argument("--seed", type=int, default=0, help="for --sampled")
    parser.add_argument("--windows", type=int, default=1)
    parser.add_argument("--window-tokens", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument(
        "--apply",
        metavar="SCHEME",
        help="the scheme to give the layers to (default: --kv)",
    )
    parser.add_argument("--top", type=int, default=1, help="layers to give more bits")
    parser.add_argument(
        "--budget",
        type=float,
        metavar="BITS",
        help="instead of --top: as many layers as keep the scheme within these "
        "bits per element at 4096 tokens",
    )
    parser.add_argument("--bits", type=int, default=8, help="their bits (default 8)")
    parser.add_argument("--part", choices=("k", "kv"), default="k")
    parser.add_argument("--dtype", choices=sorted(kv_eval.DTYPES))
    parser.add_argument("--out", help="write the errors to this JSON file")
    args = parser.parse_args(argv)
    for name in filter(None, (args.kv, args.apply)):
        try:
            kv_schemes.get_scheme(name)
        except ValueError as e:
            parser.error(str(e))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    scheme = kv_schemes.get_scheme(args.kv)
    target = args.apply or args.kv
    model, tokenizer = kv_eval.load_model(args.model)
    if args.dtype:
        model.set_dtype(kv_eval.DTYPES[args.dtype])
    if args.budget is not None:
        try:
            check_budget(model, target, args.budget)
        except ValueError as e:
            raise SystemExit(f"error: {e}")
    if hint := kv_eval.blas_hint():
        print(hint, file=sys.stderr)
    tic = time.perf_counter()
    if args.sampled:
        windows = sampled_window(model, args.sampled, args.seed)
    else:
        tokens = kv_eval.encode(tokenizer, kv_eval.read_text(args.text))[args.skip :]
        windows = kv_eval.make_windows(
            tokens, args.windows, args.window_tokens, tokenizer.bos_token_id
        )
    num_layers = len(make_prompt_cache(model))
    progress = kv_eval.Progress((num_layers + 1) * len(windows))
    errors = layer_errors(model, windows, scheme, args.chunk, progress)
    progress.close()
    if args.budget is None:
        layers = top_layers(errors, args.top)
    else:
        layers = layers_within(model, errors, target, args.bits, args.part, args.budget)
    chosen = with_layers(target, layers, args.bits, args.part)
    report = {
        "model": args.model,
        "kv": args.kv,
        "apply": target,
        "budget": args.budget,
        "text": None if args.sampled else args.text,
        "skip": args.skip,
        "sampled": args.sampled,
        "seed": args.seed,
        "windows": len(windows),
        "window_tokens": windows.shape[1],
        "chunk": args.chunk,
        "dtype": args.dtype or kv_eval.model_dtype(model),
        "layer_kld": errors,
        "share": [e / sum(errors) for e in errors],
        "top": layers,
        "scheme": chosen,
        "bits_per_element": scheme_bits(model, chosen),
        "seconds": time.perf_counter() - tic,
        "versions": kv_eval.versions(),
    }
    for i, (e, share) in enumerate(zip(errors, report["share"])):
        print(f"layer {i:3d}  KLD {e:.5f}  {100 * share:5.1f}%")
    bits = report["bits_per_element"]
    print(f"scheme: {chosen}" + (f" ({bits:.3f} bits at 4096 tokens)" if bits else ""))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
