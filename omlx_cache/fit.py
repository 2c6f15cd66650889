"""Per-model profiles: which layers a scheme's ``fit=X`` gives more bits.

    python -m omlx_cache fit --model models/SmolLM2-135M-Instruct-f32 --kv cq4

A scheme's error is not spread evenly over a model's layers. For a scheme
with ``more=kB fit=X`` (the preset ``cq4``), the fit measures each layer
alone: that layer stored as the scheme stores it (for ``more=kB``, keys only,
values unquantized) and every other layer unquantized, the mean KL divergence
of the next-token distribution against the model's own caches, on tokens the
model samples itself (no data). The layers with the largest errors get the
``more`` bits, as many as keep the scheme within X bits per element at 4,096
tokens (``KVSpec.footprint``). The profile is kept per model and scheme in
``fit_dir()``; ``resolve`` reads it, or fits once (a few minutes on a CPU,
seconds on a GPU) and says so in two lines.
"""

import argparse
import hashlib
import json
import os
import sys
import time
import weakref
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .kv.spec import AVERAGE_CONTEXT, KVSpec, layer_shapes
from .measure import model_dtype, token_stats, window_logprobs

SAMPLED_TOKENS = 512
# 3: profiles of KVSpec schemes, layers within the footprint's budget
FIT_VERSION = 3
_fitted = {}  # id(model): (a weak reference to it, {settings: layers})


def sampled_tokens(model, count: int = SAMPLED_TOKENS, seed: int = 0, progress=None):
    """``count`` tokens the model samples itself (temperature 1, its own
    caches) after one token drawn at random from its vocabulary: a
    calibration text that needs no data, the same on the CPU for a model,
    dtype and ``seed``."""
    from mlx_lm.generate import generate_step

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


def measured_spec(spec: KVSpec) -> KVSpec:
    """What ranks a ``more=`` spec's layers: the spec without ``more``, and for
    ``more=kB`` with unquantized values (the keys' error alone)."""
    measured = replace(spec, more="", layers=(), fit=None)
    if spec.more.rstrip("0123456789") == "k":
        measured = replace(measured, bits=(spec.bits[0], 16))
    return measured


def layer_errors(model, windows, spec: KVSpec, chunk: int = 128, progress=None):
    """Mean KLD against the model's own caches with ``spec`` in one layer at a
    time, one value per layer, over ``windows``."""
    from mlx_lm.models.cache import make_prompt_cache

    def logprobs(tokens, cache):
        out = window_logprobs(model, tokens, cache, chunk)
        if progress:
            progress.step()
        return out

    references = [logprobs(w, make_prompt_cache(model)) for w in windows]
    errors = []
    for layer in range(len(make_prompt_cache(model))):
        klds = []
        for tokens, reference in zip(windows, references):
            cache = make_prompt_cache(model)
            cache[layer] = spec.make_cache(model)[layer]
            _, kld, _ = token_stats(logprobs(tokens, cache), tokens[1:], reference)
            klds.append(float(kld.mean()))
        errors.append(sum(klds) / len(klds))
    return errors


def ranked(errors) -> list[int]:
    return sorted(range(len(errors)), key=lambda i: -errors[i])


def layers_within(spec: KVSpec, errors, shapes, budget: float) -> list[int]:
    """The most of the layers ranked by ``errors`` that keep ``spec`` within
    ``budget`` bits per element at ``AVERAGE_CONTEXT`` tokens."""
    order = ranked(errors)

    def bits(n):
        chosen = spec.with_layers(order[:n])
        return chosen.footprint(shapes, AVERAGE_CONTEXT)["bits_per_element"]

    if bits(0) > budget:
        raise ValueError(
            f"{spec}: {bits(0):.3f} bits per element without more bits, "
            f"over fit={budget:g}."
        )
    low, high = (
        0,
        len(errors),
    )  # bits(low) fits; the largest n that fits is in low..high
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if bits(mid) <= budget else (low, mid - 1)
    return sorted(order[:low])


def fit_dir() -> Path:
    """Where profiles are kept: ``$OMLX_CACHE_HOME/profiles``, by default
    ``~/.cache/omlx-cache/profiles``."""
    root = os.environ.get("OMLX_CACHE_HOME") or Path.home() / ".cache" / "omlx-cache"
    return Path(root) / "profiles"


def model_fingerprint(model) -> str:
    """A digest of the model's parameters: names, shapes, types and the first
    values of each."""
    digest = hashlib.sha256()
    for name, x in tree_flatten(model.parameters()):
        digest.update(f"{name} {x.shape} {x.dtype}".encode())
        digest.update(np.array(x.reshape(-1)[:64].astype(mx.float32)).tobytes())
    return digest.hexdigest()


def _read(path: Path):
    """The layers of the profile at ``path``, or None (none, or unreadable)."""
    try:
        layers = json.loads(path.read_text())["layers"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"omlx_cache fit: ignoring {path} ({e}); fitting again", file=sys.stderr)
        return None
    if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
        print(f"omlx_cache fit: ignoring {path} (no layer list)", file=sys.stderr)
        return None
    return layers


def _write(path: Path, report: dict):
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_suffix(f".{os.getpid()}.tmp")
        temp.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(temp, path)
    except OSError as e:
        print(
            f"omlx_cache fit: cannot keep the profile in {path} ({e})", file=sys.stderr
        )


def _known(model) -> dict:
    entry = _fitted.get(id(model))
    if entry is None or entry[0]() is not model:
        entry = _fitted[id(model)] = (weakref.ref(model), {})
    return entry[1]


def fit_tokens(model) -> int:
    """``SAMPLED_TOKENS``, or a model's shortest sliding window if shorter: a
    layer measured alone holds the whole text, beside windowed caches."""
    shapes = [s for s in layer_shapes(model) if s is not None]
    return min([SAMPLED_TOKENS, *(s.window for s in shapes if s.window)])


def resolve(spec: KVSpec, model) -> KVSpec:
    """``spec`` with ``fit=X`` turned into the model's layers (its profile, or
    a fit made now and kept); other specs as they are."""
    if spec.fit is None:
        return spec
    settings = {
        "spec": replace(spec, name="").text,
        "dtype": model_dtype(model),
        "version": FIT_VERSION,
    }
    known = _known(model)
    memo = json.dumps(settings, sort_keys=True)
    if memo not in known:
        known[memo] = fit(spec, model, settings)
    return spec.with_layers(known[memo])


def fit(spec: KVSpec, model, settings: dict) -> list[int]:
    """The layers of ``spec``'s profile for ``model`` (read, or fitted now)."""
    settings = dict(settings, sampled=fit_tokens(model))
    key = json.dumps(settings, sort_keys=True)
    digest = hashlib.sha256((model_fingerprint(model) + key).encode()).hexdigest()
    path = fit_dir() / f"{digest[:32]}.json"
    layers = _read(path)
    if layers is not None:
        return layers
    shapes = layer_shapes(model)
    tic = time.perf_counter()
    count = settings["sampled"]
    print(
        f"omlx_cache fit: {spec} for this model, once ({count} sampled tokens, "
        f"{len(shapes) + 1} passes; kept in {fit_dir()})",
        file=sys.stderr,
        flush=True,
    )
    windows = sampled_tokens(model, count)[None]
    errors = layer_errors(model, windows, measured_spec(spec))
    layers = layers_within(spec, errors, shapes, spec.fit)
    chosen = spec.with_layers(layers)
    report = dict(settings, layer_kld=errors, layers=layers, scheme=chosen.text)
    report["seconds"] = time.perf_counter() - tic
    _write(path, report)
    print(
        f"omlx_cache fit: {chosen.text} ({report['seconds']:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    return layers


def main(argv=None) -> dict:
    from mlx_lm import load

    parser = argparse.ArgumentParser(
        prog="python -m omlx_cache fit",
        description="Fit a scheme's fit=X layers to a model and keep its profile.",
    )
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--kv", default="cq4", metavar="SCHEME", help="default cq4")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"))
    args = parser.parse_args(argv)
    try:
        spec = KVSpec.parse(args.kv)
    except ValueError as e:
        parser.error(f"--kv: {e}")
    if spec.fit is None:
        parser.error(f"--kv {args.kv}: the scheme has no fit= to fit.")
    model, _ = load(args.model)
    if args.dtype:
        model.set_dtype(getattr(mx, args.dtype))
    chosen = resolve(spec, model)
    shapes = layer_shapes(model)
    bits = chosen.footprint(shapes, AVERAGE_CONTEXT)["bits_per_element"]
    print(f"{chosen.text}  ({bits:.3f} bits per element at {AVERAGE_CONTEXT} tokens)")
    return {"scheme": chosen.text, "layers": list(chosen.layers), "bits": bits}


if __name__ == "__main__":
    main()
