"""KV cache schemes by name, for evaluation and benchmarks.

A scheme string such as ``fp16``, ``8``, ``8,4``, ``4+rotate``,
``4+rotate+center/g32``, ``4+rotate+exact4``, ``4+rotate+k8@11`` or
``4,3+rotate+center+res72/g64,32~4+rotate+center`` (``A~B``: B in the
bounded layers) names how a model's keys and values are stored.
``get_scheme`` turns it into a ``Scheme``: a factory ``(model) -> list of
caches`` plus the bits per element the format costs.

The codecs live in their own modules (``center``, ``codebook``), which know
nothing of schemes; their names are registered here. New formats register a
pattern and a builder, e.g.::

    @register(r"codebook-(?P<bits>\\d)", syntax="codebook-B", help="...")
    def codebook(name, group_size, bits):
        return Scheme(name, lambda model: ..., bits_per_element=...)
"""

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from mlx import nn
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    check_kv_quantization,
    kv_pair,
    make_prompt_cache,
)

from .center import (
    CenteredQuantizedKVCache,
    CenteredQuantizedRotatingKVCache,
    centered,
)
from .codebook import (
    NORM_BITS,
    Affine,
    Codebook,
    CodebookKVCache,
    Plain,
    WindowedCodebookKVCache,
)

# the scales and biases of affine quantization, as a float16 / bfloat16 model stores them
SCALE_BITS = 16


@dataclass(frozen=True)
class Scheme:
    name: str
    make_cache: Callable[[nn.Module], list]
    # (key, value) bits per element as stored, scales and biases included (of
    # most layers, kept tokens left out: ``average_bits`` counts everything)
    bits_per_element: tuple[float, float]
    # (key, value) group sizes of a quantized scheme
    group_size: tuple[int, int] | None = None
    # the plain cache every other scheme is compared against
    is_reference: bool = False
    # tokens per sequence also kept unquantized (``keep_exact``)
    kept_tokens: int = 0
    # layers stored with more bits
    high_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Entry:
    pattern: re.Pattern
    builder: Callable[..., Scheme]
    syntax: str
    help: str


_REGISTRY: list[_Entry] = []


def register(pattern: str, syntax: str, help: str = ""):
    """Register ``builder(name, group_size, **named_groups) -> Scheme`` for the
    scheme strings that fully match ``pattern``."""

    def wrap(builder):
        _REGISTRY.append(_Entry(re.compile(pattern), builder, syntax, help))
        return builder

    return wrap


# Schemes by a short name (docs/results.md): q4 has the lowest error at 4.6
# bits on SmolLM2 and Gemma 3; q4-recall (4.57 bits) has 4-bit values, as
# Q4's 3-bit ones lose passkeys; cq4 (4.6 bits) loses the fewest, its 5-bit
# key layers fitted per model
PRESETS = {
    "q4": "4,3+rotate+center+qscale+exact8+res72/g64,32"
    "~4+rotate+center+qscale+exact8+k5@4.8",
    "q4-recall": "4+rotate+center+qscale+exact16",
    "cq4": "codebook-4+center+qscale+exact8+k5@fit4.6",
}


def get_scheme(name: str, group_size=64) -> Scheme:
    """The scheme for ``name`` (or for the scheme string a preset name stands
    for); ``group_size`` is an int or a (key, value) pair."""
    name = name.strip()
    name = PRESETS.get(name, name)
    for entry in _REGISTRY:
        match = entry.pattern.fullmatch(name)
        if match:
            return entry.builder(name, group_size, **match.groupdict())
    raise ValueError(f"Unknown KV cache scheme {name!r}; known forms: {known_forms()}.")


def layer_windows(model: nn.Module) -> list[int | None]:
    """Each layer's sliding window (the ``max_size`` of the rotating cache
    the model makes for it), or None where it attends the whole context."""
    return [getattr(c, "max_size", None) for c in make_prompt_cache(model)]


def bounded_layers(model: nn.Module) -> list[bool]:
    """Which layers of ``model`` make a bounded (sliding-window) cache by
    default, as Gemma 3's local layers do."""
    return [window is not None for window in layer_windows(model)]


def windowed(scheme: Scheme, max_kv_size: int, keep: int = 4) -> Scheme:
    """``scheme`` with a bounded context, as ``--max-kv-size`` gives it: each
    layer's cache becomes a rotating one of ``max_kv_size`` tokens that keeps the
    first ``keep``, quantized as the scheme's cache is. Layers bounded already
    (sliding windows) keep their caches, as in ``make_prompt_cache``."""

    def rotating(cache):
        if hasattr(cache, "max_size"):
            return cache
        window = RotatingKVCache(max_size=max_kv_size, keep=keep)
        if type(cache) is KVCache:
            return window
        if type(cache) is QuantizedKVCache:
            return window.to_quantized(
                cache.group_size, cache.bits, cache.rotate, cache.keep_exact
            )
        if type(cache) is CenteredQuantizedKVCache:
            return CenteredQuantizedRotatingKVCache(
                max_kv_size,
                keep,
                cache.group_size,
                cache.bits,
                cache.rotate,
                cache.center,
                cache.keep_exact,
                cache.key_scale,
            )
        raise ValueError(
            f"Scheme {scheme.name!r} has no bounded-context form "
            f"({type(cache).__name__})."
        )

    def make_cache(model):
        return [rotating(c) for c in scheme.make_cache(model)]

    return replace(scheme, name=f"{scheme.name}@w{max_kv_size}", make_cache=make_cache)


def known_forms() -> str:
    return ", ".join([*PRESETS, *(entry.syntax for entry in _REGISTRY)])


def describe() -> str:
    """One line per preset and registered form, for ``--help``."""
    presets = [f"{name}: {scheme}" for name, scheme in PRESETS.items()]
    forms = [f"{entry.syntax}: {entry.help}" for entry in _REGISTRY]
    return "; ".join(presets + forms)


def parse_group_size(text: str):
    """``"64"`` -> 64, ``"64,32"`` -> (64, 32)."""
    parts = [int(part) for part in text.split(",")]
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return tuple(parts)
    raise ValueError(f"Group size must be N or K,V, got {text!r}.")


def plain_layers(model: nn.Module, windows: bool = False) -> int:
    """Number of layers of a model whose default cache is a plain KVCache per
    layer. With ``windows``, sliding-window layers (a ``RotatingKVCache`` that
    keeps no first tokens, as Gemma 3 makes) count as plain: a cache that
    holds the whole context gives the same attention when the model asks
    the cache for its window mask (``make_mask(window_size=...)``, as Gemma 3
    does), only holding more tokens than the window."""

    def plain(c):
        if type(c) is KVCache:
            return True
        return windows and type(c) is RotatingKVCache and c.keep == 0

    caches = make_prompt_cache(model)
    if not all(map(plain, caches)):
        kinds = sorted({type(c).__name__ for c in caches})
        raise ValueError(
            f"These schemes need a plain KVCache per layer"
            f"{' (or a sliding window)' if windows else ''}; this model makes "
            f"{kinds}."
        )
    return len(caches)


@register(r"fp16", syntax="fp16", help="plain KVCache in the model's dtype (reference)")
def fp16(name, group_size):
    return Scheme(
        name,
        make_prompt_cache,
        bits_per_element=(16.0, 16.0),
        is_reference=True,
    )


def affine_bits(bits: int, group_size: int) -> float:
    """Bits per element of affine quantization: the codes plus one scale and one
    bias per group."""
    return bits + 2 * SCALE_BITS / group_size


def layer_bits(cache) -> tuple[float, float] | None:
    """(key, value) bits per element of one layer's cache as a 16-bit model
    stores it: affine quantized caches by their settings, codebook ones by
    their codecs at their head dims (once they hold tokens), plain ones 16;
    None for other caches."""
    if isinstance(cache, CodebookKVCache):
        return cache.bits_per_element
    if hasattr(cache, "key_bits") and hasattr(cache, "key_group_size"):
        return (
            affine_bits(cache.key_bits, cache.key_group_size),
            affine_bits(cache.value_bits, cache.value_group_size),
        )
    if type(cache) in (KVCache, RotatingKVCache):
        return (SCALE_BITS, SCALE_BITS)
    return None


def residual_tokens(residual: int, tokens: int) -> int:
    """Tokens a cache with this ``residual`` holds unquantized after
    ``tokens`` (``QuantizedKVCache``: ``residual`` to ``2 * residual - 1``,
    all of them before ``2 * residual``)."""
    if not residual or tokens < 2 * residual:
        return tokens if residual else 0
    return residual + (tokens - residual) % residual


def per_head_bits(cache) -> tuple[int, int]:
    """(key, value) bits per channel a cache stores once per head and
    sequence: float32 key weights (``key_scale``, codebook and affine
    caches) and a codebook cache's float32 means (``center``), each as much
    as one token of float32 elements. (Affine centered caches hold means
    too; they are left out, as before.)"""
    key = 32 if getattr(cache, "key_weights", None) is not None else 0
    if not isinstance(cache, CodebookKVCache):
        return (key, 0)
    key += 32 if cache.key_mean is not None else 0
    return (key, 32 if cache.value_mean is not None else 0)


def mean_residual_tokens(residual: int, tokens: int) -> float:
    """Tokens a cache with this ``residual`` holds unquantized after
    ``tokens``, averaged over one quantization cycle once it has begun (it
    holds ``residual`` to ``2 * residual - 1``): the count at one length
    depends on where that length falls in the cycle."""
    if not residual or tokens < 2 * residual:
        return residual_tokens(residual, tokens)
    return (3 * residual - 1) / 2


def average_bits(caches, context: int) -> tuple[float, float] | None:
    """(key, value) bits per element over everything ``caches`` (one per
    layer) store for a sequence of ``context`` tokens: a bounded layer holds
    at most its ``max_size`` tokens, tokens kept unquantized (``keep_exact``)
    add 16 bits an element each while they are kept (a bounded layer that
    keeps its first ``keep`` tokens keeps at most those unquantized; one that
    keeps none, none once it has evicted), and the recent tokens a
    ``residual`` holds unquantized (``mean_residual_tokens``) cost 16 bits
    instead of the format's, and a codebook cache's float32 means and any
    cache's key weights 32 bits per channel once (``per_head_bits``).
    Layers are assumed to have the same number of heads and head sizes.
    None when a layer's cache is not an affine, codebook or plain one (or is
    an empty codebook one, whose head dims are not known yet)."""
    totals, elements = [0.0, 0.0], 0
    for cache in caches:
        bits = layer_bits(cache)
        if bits is None:
            return None
        window = getattr(cache, "max_size", None)
        tokens = context if window is None else min(context, window)
        held = mean_residual_tokens(getattr(cache, "residual", 0), tokens)
        kept = getattr(cache, "keep_exact", 0)
        keep = getattr(cache, "keep", 0)
        if window is not None and (keep or tokens < context):
            kept = min(kept, keep)
        kept = min(kept, tokens - held)
        per_head = per_head_bits(cache)
        for i in range(2):
            totals[i] += (tokens - held) * bits[i] + (held + kept) * SCALE_BITS
            totals[i] += per_head[i]
        elements += tokens
    return tuple(t / elements for t in totals)


CENTER_SUFFIX = r"(?P<center>\+center(?P<center_values>-kv)?)?"
QSCALE_SUFFIX = r"(?P<qscale>\+qscale(?P<qscale_mode>-q)?)?"
GROUP_SUFFIX = r"(/g(?P<groups>\d+(,\d+)?))?"
EXACT_SUFFIX = r"(\+exact(?P<exact>\d+))?(\+res(?P<residual>\d+))?"
LAYERS_SUFFIX = r"(\+(?P<layer_part>kv|k)(?P<layer_bits>\d+)@(?P<layers>\d+(\.\d+)*))?"
# or +k5@fit4.6: the layers fitted per model within 4.6 bits (layers.fitted_layers)
FITTED_LAYERS_SUFFIX = (
    r"(\+(?P<layer_part>kv|k)(?P<layer_bits>\d+)@"
    r"(?P<layers>\d+(\.\d+)*|fit\d+(\.\d+)?))?"
)


def parse_layers(text: str) -> tuple[int, ...]:
    """``"11.19"`` -> (11, 19)."""
    return tuple(sorted({int(x) for x in text.split(".")}))


def center_option(center, center_values) -> str:
    """The ``center`` setting of a scheme name's ``+center`` / ``+center-kv``."""
    if center is None:
        return ""
    return "kv" if center_values else "k"


def key_scale_option(qscale, qscale_mode) -> str:
    """The ``key_scale`` setting of a scheme name's ``+qscale`` / ``+qscale-q``."""
    if qscale is None:
        return ""
    return "q" if qscale_mode else "qk"


@register(
    r"(?P<key_bits>\d+)(,(?P<value_bits>\d+))?(?P<rotate>\+rotate)?"
    + CENTER_SUFFIX
    + QSCALE_SUFFIX
    + EXACT_SUFFIX
    + LAYERS_SUFFIX
    + GROUP_SUFFIX,
    syntax="B or K,V [+rotate] [+center|+center-kv] [+qscale|+qscale-q] [+exactN] "
    "[+resR] [+kB@L.L|+kvB@L.L] [/gG or /gGK,GV]",
    help="mlx affine QuantizedKVCache from the first token, K and V bits; "
    "+rotate stores keys and values rotated before quantizing them; +center "
    "stores keys minus their per-head mean of the first write "
    "(CenteredQuantizedKVCache), +center-kv values too; +qscale (after +center) "
    "weighs the keys' channels by the first write's queries over its keys "
    "(key_scale='qk'), +qscale-q by the queries alone ('q'); +exactN keeps each "
    "sequence's first N tokens unquantized too (keep_exact=N); +resR keeps the "
    "last R to 2R-1 tokens unquantized in unbounded layers (residual=R); +k8@11.19 "
    "gives the keys of layers 11 and 19 8 bits (+kv8@: keys and values; "
    "python -m omlx_cache.layers picks layers); /g: group size "
    "(else --kv-group-size)",
)
def affine(
    name,
    group_size,
    key_bits,
    value_bits=None,
    rotate=None,
    center=None,
    center_values=None,
    qscale=None,
    qscale_mode=None,
    exact=None,
    residual=None,
    layer_part=None,
    layer_bits=None,
    layers=None,
    groups=None,
):
    bits = (int(key_bits), int(value_bits or key_bits))
    keep_exact = int(exact or 0)
    residual = int(residual or 0)
    if groups is not None:
        group_size = parse_group_size(groups)
    group_sizes, bits = check_kv_quantization(kv_pair(group_size), bits)
    rotate = rotate is not None
    center = center_option(center, center_values)
    key_scale = key_scale_option(qscale, qscale_mode)
    if key_scale and not center:
        raise ValueError(f"{name}: +qscale needs +center (centered caches weigh keys).")
    high_layers = ()
    if layers is not None:
        high_layers = parse_layers(layers)
        more = int(layer_bits)
        high_bits = (more, more if layer_part == "kv" else bits[1])
        _, high_bits = check_kv_quantization(group_sizes, high_bits)

    def make_layers(model, bits):
        # as generation makes them: sliding-window layers get quantized
        # rotating caches
        caches = make_prompt_cache(
            model,
            kv_bits=bits,
            kv_group_size=group_sizes,
            kv_rotate=rotate,
            kv_keep_exact=keep_exact,
            kv_residual=residual,
        )
        if center:
            caches = [centered(c, center, key_scale) for c in caches]
        return caches

    def make_cache(model):
        caches = make_layers(model, bits)
        if high_layers:
            if high_layers[-1] >= len(caches):
                raise ValueError(
                    f"{name}: layer {high_layers[-1]} of a model with "
                    f"{len(caches)} layers."
                )
            high = make_layers(model, high_bits)
            caches = [high[i] if i in high_layers else c for i, c in enumerate(caches)]
        return caches

    return Scheme(
        name,
        make_cache,
        bits_per_element=tuple(map(affine_bits, bits, group_sizes)),
        group_size=group_sizes,
        kept_tokens=keep_exact,
        high_layers=high_layers,
    )


# head dim at which a codebook scheme's nominal bits per element are given (the
# norm's 16 bits are shared by D elements); the eval reports the stored bits too
NOMINAL_HEAD_DIM = 128

CODEBOOK_SCHEME = (
    r"codebook-(?P<key_bits>\d+)(k-(?P<affine>a?)(?P<value_bits>\d+)v)?"
    r"(-(?P<rotation>hadamard|givens|none))?(-(?P<norm>dot|length|plain))?"
    r"(-n(?P<norm_bits>8|16))?"
    + CENTER_SUFFIX
    + QSCALE_SUFFIX
    + r"(\+exact(?P<exact>\d+))?"
    + FITTED_LAYERS_SUFFIX
    + r"(\+v(?P<value_layer_bits>\d+)@(?P<value_layers>\d+(\.\d+)*|global))?"
    + r"(?P<debias>\+debias(?P<debias_scale>\d+(\.\d+)?)?)?"
)


def scheme_codecs(
    key_bits, value_bits=None, affine="", rotation=None, norm=None, norm_bits=None
):
    """The (key, value) codecs of a ``codebook-...`` scheme name's parts: 16
    bits is ``Plain``; ``affine`` makes the values affine (group size 64)."""
    rotation, norm = rotation or "hadamard", norm or "dot"
    norm_bits = int(norm_bits or NORM_BITS)

    def one(bits, is_affine=False):
        bits = int(bits)
        if bits == 16:
            return Plain()
        if is_affine:
            return Affine(bits, 64, rotation)
        return Codebook(bits, rotation, norm, norm_bits)

    keys = one(key_bits)
    values = keys if value_bits is None else one(value_bits, bool(affine))
    return keys, values


@register(
    CODEBOOK_SCHEME,
    syntax="codebook-B, codebook-Kk-Vv, codebook-Kk-aVv [-givens|-none] [-n8] "
    "[+center|+center-kv] [+qscale|+qscale-q] [+exactN] [+kB@L.L|+kvB@L.L|+kB@fitX] "
    "[+vB@L.L|+vB@global] [+debias|+debiasX]",
    help="CodebookKVCache: B-bit Lloyd-Max codebook after a Hadamard rotation "
    "(-givens: PlanarQuant pairs) plus a float16 norm per vector (-n8: an 8-bit "
    "log norm); Kk-Vv: K and V bits (16 = unquantized), aV: affine V (Hadamard, "
    "group 64); +center: keys minus their per-head mean of the first write, "
    "+center-kv values too; +qscale weighs the keys' channels by the queries' "
    "energy over the keys' (query_key_weights, set at the first attention call), "
    "+qscale-q by the queries' alone; "
    "+exactN keeps each sequence's first N tokens "
    "unquantized too; +k4@1.2: the keys of layers 1 and 2 at 4 bits (+kv4@: "
    "keys and values; +v4@: values, after +k; +k5@fit4.6: in the layers that fit 4.6 bits per "
    "element, ranked per model on text it samples itself, once, kept in ~/.cache/omlx-cache; "
    "+v5@global: the values of the layers that attend the whole context in a model with "
    "sliding-window layers); +debias takes half the expected variance of each "
    "decoded key's score error off its score (MLX ops; the CUDA kernels decline it), "
    "+debias2 twice that; "
    "sliding-window layers drop the pages their window no longer sees "
    "(WindowedCodebookKVCache)",
)
def codebook(
    name,
    group_size,
    key_bits,
    value_bits,
    affine,
    rotation,
    norm,
    norm_bits,
    center,
    center_values,
    qscale=None,
    qscale_mode=None,
    exact=None,
    layer_part=None,
    layer_bits=None,
    layers=None,
    value_layer_bits=None,
    value_layers=None,
    debias=None,
    debias_scale=None,
):
    keys, values = scheme_codecs(
        key_bits, value_bits, affine, rotation, norm, norm_bits
    )
    strength = float(debias_scale) if debias_scale else True
    keys = debiased(keys, strength) if debias else keys
    center = center_option(center, center_values)
    keep_exact = int(exact or 0)
    high_layers, high, fit = (), (keys, values), None
    if layers is not None and layers.startswith("fit"):
        fit = fitting(name, key_bits, layer_bits, layer_part, float(layers[3:]))
    elif layers is not None:
        high_layers = parse_layers(layers)
    if layers is not None:
        more = scheme_codecs(layer_bits, None, "", rotation, norm, norm_bits)[0]
        high = (
            debiased(more, strength) if debias else more,
            more if layer_part == "kv" else values,
        )
    value_high_layers, value_high = (), values
    if value_layers is not None:
        if value_layers != "global":
            value_high_layers = parse_layers(value_layers)
        value_high = scheme_codecs(
            value_layer_bits, None, "", rotation, norm, norm_bits
        )[0]

    def make_cache(model):
        n = plain_layers(model, windows=True)
        chosen = high_layers if fit is None else fit(model)
        chosen_values = value_high_layers
        if value_layers == "global":
            chosen_values = global_layers(model)

        def codecs(i):
            k, v = high if i in chosen else (keys, values)
            return k, value_high if i in chosen_values else v

        last = max(chosen[-1:] + chosen_values[-1:], default=-1)
        if last >= n:
            raise ValueError(f"{name}: layer {last} of a model with {n} layers.")
        settings = {
            "center": center,
            "keep_exact": keep_exact,
            "key_scale": key_scale_option(qscale, qscale_mode),
        }
        return [
            CodebookKVCache(*codecs(i), **settings)
            if window is None
            else WindowedCodebookKVCache(window, *codecs(i), **settings)
            for i, window in enumerate(layer_windows(model))
        ]

    bits = (c.bits_per_element(NOMINAL_HEAD_DIM) for c in (keys, values))
    return Scheme(
        name,
        make_cache,
        bits_per_element=tuple(bits),
        kept_tokens=keep_exact,
        high_layers=tuple(sorted({*high_layers, *value_high_layers})),
    )


def debiased(codec, strength=True):
    """``codec`` with ``debias=strength`` where it is a codebook (keys)."""
    return replace(codec, debias=strength) if isinstance(codec, Codebook) else codec


def global_layers(model: nn.Module) -> tuple[int, ...]:
    """The layers that attend the whole context in a model with sliding-window
    layers (Gemma 3's every sixth); none in a model without them."""
    bounded = bounded_layers(model)
    if not any(bounded):
        return ()
    return tuple(i for i, b in enumerate(bounded) if not b)


def fit_names(name, key_bits, bits, part) -> tuple[str, str]:
    """The scheme a ``+kB@fitX`` name's layers are ranked for, and the one
    that measures them (``fitting``)."""
    # ranked without the score correction: a scheme and its +debias pick alike
    base = re.sub(rf"\+{part}{bits}@fit[\d.]+|\+debias[\d.]*$", "", name)
    measure = base
    if part == "k":
        measure = re.sub(r"^codebook-\d+(k-a?\d+v)?", f"codebook-{key_bits}k-16v", base)
        measure = re.sub(r"\+v\d+@[\w.]+", "", measure)
    return base, measure


def fitting(name, key_bits, bits, part, budget):
    """``model -> layers`` for a codebook scheme name with ``+kB@fitX``
    (``layers.fitted_layers``): the layers are ranked by the name without it,
    keys alone (values unquantized, no ``+vB@``) for ``+k``."""
    base, measure = fit_names(name, key_bits, bits, part)

    def fit(model):
        from .layers import fitted_layers  # layers imports this module

        return tuple(fitted_layers(model, base, measure, int(bits), part, budget))

    return fit


@register(
    r"(?P<whole>[^~]+)~(?P<bounded>[^~]+)",
    syntax="A~B",
    help="scheme A in the layers whose cache holds the whole context and B in "
    "the bounded (sliding-window) layers the model makes, e.g. Gemma 3's "
    "512-token windows, which at long contexts hold a small share of the cache "
    "(a model without them: A alone)",
)
def split_by_window(name, group_size, whole, bounded):
    parts = [get_scheme(part, group_size) for part in (whole, bounded)]

    def make_cache(model):
        whole_caches, bounded_caches = (part.make_cache(model) for part in parts)
        if len(whole_caches) != len(bounded_caches):
            raise ValueError(f"{name}: the two schemes make different layer counts.")
        return [
            b if is_bounded else w
            for w, b, is_bounded in zip(
                whole_caches, bounded_caches, bounded_layers(model)
            )
        ]

    return replace(parts[0], name=name, make_cache=make_cache, is_reference=False)
