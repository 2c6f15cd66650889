"""The KV caches of ``mlx_lm.generate`` and ``mlx_lm.server``, through their
``--kv-cache`` hook (this package's entry points ``default`` and ``omlx`` in
the group ``mlx_lm.kv_caches``).

    mlx_lm.server --model models/SmolLM2-135M-Instruct-f32 --kv-bits 4
    mlx_lm.server --model ... --kv-cache-config "cq4"
    mlx_lm.generate --model ... --kv-bits 8,4 --kv-cache-config "group=64,32"

The scheme is ``--kv-cache-config`` (a preset or ``name=value`` items,
``omlx_cache.kv.spec``; default: the model's own caches) with ``--kv-bits``
and ``--kv-group-size`` as its ``bits=`` and ``group=``. A scheme with
``fit=`` is fitted to the model when its first cache is made (at load), once
per model. The first cache also prints one line: the layers quantized, the
bits per element and the bytes per token of the scheme.
"""

import sys

from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from . import fit
from .kv.spec import AVERAGE_CONTEXT, KVSpec, layer_ranges, layer_shapes


def _pair(value) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return str(value)


def spec_from_args(args) -> KVSpec:
    """The scheme ``--kv-cache-config``, ``--kv-bits`` and ``--kv-group-size``
    name together (ValueError naming the flag that does not fit)."""
    config = getattr(args, "kv_cache_config", None) or ""
    bits = getattr(args, "kv_bits", None)
    group = getattr(args, "kv_group_size", 64)
    try:
        given = KVSpec.fields(config)
    except ValueError as e:
        raise ValueError(f"--kv-cache-config {config!r}: {e}") from None
    items = []
    if bits is not None:
        if "bits" in given:
            raise ValueError(
                f"--kv-bits {_pair(bits)} and --kv-cache-config {config!r} both "
                "set the bits."
            )
        items.append(f"bits={_pair(bits)}")
    if group not in (None, 64, (64, 64), [64, 64]):
        if bits is None and "bits" not in given:
            raise ValueError("--kv-group-size needs --kv-bits.")
        items.append(f"group={_pair(group)}")
    if not items:
        try:
            return KVSpec.parse(config)
        except ValueError as e:
            raise ValueError(f"--kv-cache-config {config!r}: {e}") from None
    try:
        return KVSpec.parse(" ".join([config, *items]).strip())
    except ValueError as e:
        flags = "--kv-bits / --kv-group-size" + (
            " with --kv-cache-config" if config else ""
        )
        raise ValueError(f"{flags}: {e}") from None


def describe(spec: KVSpec, model, max_kv_size=None) -> str:
    """One line: the layers quantized, bits per element, bytes per token."""
    caches = make_prompt_cache(model, max_kv_size)
    own = layer_shapes(model, max_kv_size, caches)
    shapes = spec.stored_shapes(model, own, max_kv_size)
    quantized = spec.quantized_layers(shapes)
    footprint = spec.footprint(shapes, AVERAGE_CONTEXT)
    line = (
        f"omlx_cache: KV cache {spec.text}: {quantized} of {len(shapes)} layers "
        f"quantized, {footprint['bits_per_element']:.2f} bits per element, "
        f"{footprint['bytes_per_token']:,.0f} bytes per token at {AVERAGE_CONTEXT} tokens"
    )
    notes = spec.fitted_dims(shapes)
    bounded = [
        i for i, (s, o) in enumerate(zip(shapes, own)) if s is None and o is not None
    ]
    if bounded:
        notes.append(
            f"bounded layers {layer_ranges(bounded)} keep the model's own caches (it reads "
            "its keys itself, and a quantized window's rows do not carry its sinks)"
        )
    for name, layers in _without_quantized_form(caches).items():
        notes.append(
            f"layers {layer_ranges(layers)} keep the model's own {name} "
            "(no quantized form yet)"
        )
    return "\n".join([line, *(f"omlx_cache: {n}" for n in notes)])


def _without_quantized_form(caches) -> dict:
    """Layers, by cache class, whose own caches (``caches``) hold keys and
    values the stores cannot take (recurrent state is not a KV cache; a
    ``CacheList``'s KV caches become stores)."""
    out = {}
    for i, c in enumerate(caches):
        if type(c) in (KVCache, RotatingKVCache) or isinstance(
            c, (ArraysCache, CacheList)
        ):
            continue
        out.setdefault(type(c).__name__, []).append(i)
    return out


def from_args(args):
    """The entry point: ``make_cache(model, max_kv_size)`` for the scheme the
    command line names."""
    spec = spec_from_args(args)
    described = set()

    def make_cache(model, max_kv_size=None):
        model_spec = fit.resolve(spec, model)
        if not spec.is_reference and id(model) not in described:
            described.add(id(model))
            print(describe(model_spec, model, max_kv_size), file=sys.stderr, flush=True)
        return model_spec.make_cache(model, max_kv_size)

    return make_cache
