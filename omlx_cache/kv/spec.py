"""The scheme language: one typed spec for the CLI, the server, the eval and
the benchmarks, its parser and printer, the footprint, and the caches it
makes for a model.

A scheme is ``fp16`` (the model's own caches), a preset name, or items
``name=value`` separated by spaces (a preset may come first and the items
after it change it)::

    bits=4                       affine 4-bit keys and values (rotated, keys
                                 centered and weighted, first 32 kept)
    bits=8,4 group=64,32         keys 8-bit in groups of 64, values 4-bit in groups of 32
    bits=4 rotate=none first=0   mlx-lm's plain affine 4-bit
    8,4                          a lone number (pair) is bits=
    cq4 first=16                 a preset, changed

The items (``K,V``: keys and values apart; one value: both):

- ``codec=affine|codebook`` (K,V): mlx's affine quantization or a Lloyd-Max
  codebook on rotated vectors (``codecs``); default affine.
- ``bits=B`` (K,V): 2-8 (affine), 1-6 (codebook); 16 stores that part
  unquantized.
- ``group=G`` (K,V): affine group size, 32, 64 or 128; default 64.
- ``offset=float|int`` (K,V): how an affine group stores its offset: a
  float16 bias beside its float16 scale (mlx's, default), or an integer zero
  point in one 16-bit word with the scale (bits 2, 4 or 8; ``codecs``):
  ``group=32 offset=int`` costs what groups of 64 do.
- ``rotate=kv|k|v|none``: Hadamard rotation before quantizing. Default: kv
  when a part has fewer than 8 bits, else none (codebooks always rotate).
- ``center=k|kv|none``, ``qscale=qk|q|none``: the transform (``transform``);
  default k and qk for affine keys under 8 bits (unless ``first`` is set
  under 2), else none.
- ``first=N``: each sequence's first N tokens kept unquantized, a sequence's
  pages beginning after them (and what ``center`` and ``qscale`` are
  measured on: 2 or more with them). Default: 32 with ``center`` or
  ``qscale``, else 16 when an affine part has fewer than 8 bits, else 0.
- ``recent=R``: the last R to 2R - 1 tokens held unquantized (a multiple of 8).
- ``debias=X``: codebook keys' score correction, X times the expected one.
- ``more=kB|vB|kvB`` with ``layers=L,L,...`` or ``fit=X``: those layers'
  keys (values, both) at B bits: the listed layers, or the layers a model's
  fitted profile ranks first within X bits per element (``fit``).
"""

import itertools
import weakref
from dataclasses import dataclass, field, replace

import mlx.core as mx

from .codecs import OFFSETS, SCALE_BITS, Affine, Codebook, Plain, for_dim, why_not
from .spans import check_tokens
from .store import KVStore
from .transform import CENTERS, KEY_SCALES

PRESETS = {
    # 4.6 bits: 4-bit codebook keys and values, keys centered and weighted by
    # the queries, the first 32 tokens kept, 5-bit keys in the layers a
    # model's profile ranks first within 4.6 bits per element
    "cq4": "codec=codebook bits=4 center=k qscale=qk first=32 more=k5 fit=4.6",
    # 4.6 bits: what bits=4 is by default, by name
    "q4-recall": "bits=4 center=k qscale=qk first=32",
    # 4.8 bits: bits=4 with a residual of 72 to 143 tokens held unquantized
    # (the CUDA kernels' bits: 3-bit values decoded at a third of its speed)
    "q4": "bits=4 center=k qscale=qk first=8 recent=72",
}
ROTATES = {
    "kv": (True, True),
    "k": (True, False),
    "v": (False, True),
    "none": (False, False),
}
CODECS = ("affine", "codebook")
# the context at which ``bits_per_element`` is given by default
AVERAGE_CONTEXT = 4096


def _pair(text: str, name: str, cast=int):
    parts = text.split(",")
    if len(parts) not in (1, 2) or not all(parts):
        raise ValueError(f"{name}={text!r}: expected one value or two (K,V).")
    try:
        values = tuple(cast(p) for p in parts)
    except ValueError:
        raise ValueError(f"{name}={text!r}: not a number.") from None
    return values if len(values) == 2 else values * 2


def _choice(text: str, name: str, choices) -> str:
    if text not in choices:
        raise ValueError(f"{name}={text!r}: one of {', '.join(choices)}.")
    return text


@dataclass(frozen=True)
class KVSpec:
    """What a scheme stores. ``bits`` None: the model's own (fp16) caches."""

    bits: tuple | None = None
    codec: tuple = ("affine", "affine")
    group: tuple = (64, 64)
    offset: tuple = ("float", "float")
    rotate: str | None = None  # None: the default for the bits
    center: str | None = None  # None: the default for the bits
    key_scale: str | None = None
    first: int | None = None  # None: the default for the bits
    recent: int = 0
    debias: float = 0.0
    more: str = ""  # "k5", "v4", "kv8"
    layers: tuple = ()
    fit: float | None = None
    name: str = field(default="", compare=False)

    # ------------------------------------------------------------------
    # text

    @classmethod
    def parse(cls, text: str) -> "KVSpec":
        """The spec of a scheme string (ValueError naming the bad item)."""
        text = " ".join(text.split())
        spec = cls(**cls.fields(text), name=text or "fp16")
        spec.check()
        return spec

    @staticmethod
    def fields(text: str) -> dict:
        """The fields a scheme string sets (a preset's, then its items')."""
        items = text.split()
        if items == ["fp16"]:
            return {}
        base = {}
        if items and items[0] in PRESETS:
            base = _items(PRESETS[items[0]].split(" "))
            items = items[1:]
        return {**base, **_items(items)}

    @property
    def text(self) -> str:
        """The spec as items (``parse(spec.text) == spec``)."""
        if self.bits is None:
            return "fp16"

        def pair(values):
            a, b = values
            return str(a) if a == b else f"{a},{b}"

        items = []
        if self.codec != ("affine", "affine"):
            items.append(f"codec={pair(self.codec)}")
        items.append(f"bits={pair(self.bits)}")
        if self.group != (64, 64):
            items.append(f"group={pair(self.group)}")
        if self.offset != ("float", "float"):
            items.append(f"offset={pair(self.offset)}")
        if self.rotate is not None:
            items.append(f"rotate={self.rotate}")
        if self.center is not None:
            items.append(f"center={self.center or 'none'}")
        if self.key_scale is not None:
            items.append(f"qscale={self.key_scale or 'none'}")
        if self.first is not None:
            items.append(f"first={self.first}")
        if self.recent:
            items.append(f"recent={self.recent}")
        if self.debias:
            items.append(f"debias={self.debias:g}")
        if self.more:
            items.append(f"more={self.more}")
            if self.layers:
                items.append(f"layers={','.join(map(str, self.layers))}")
            if self.fit is not None:
                items.append(f"fit={self.fit:g}")
        return " ".join(items)

    def __str__(self):
        return self.name or self.text

    @property
    def is_reference(self) -> bool:
        return self.bits is None

    def check(self):
        """ValueError naming what does not hold."""
        if self.bits is None:
            if self != KVSpec():
                raise ValueError(
                    f"{self.name or self}: a scheme needs bits= (or a preset); "
                    "fp16 takes no items."
                )
            return
        self.codecs()
        if any(self.transform) and self.first_tokens < 2:
            # what a store refuses, said when the scheme is read
            raise ValueError(
                "center= and qscale= are measured on each sequence's first "
                f"tokens: they need first=2 or more, got first={self.first_tokens}."
            )
        if self.more:
            self.more_codecs()
            if not self.layers and self.fit is None:
                raise ValueError("more= needs layers= or fit=.")
            if self.layers and self.fit is not None:
                raise ValueError("layers= and fit= exclude each other.")
        elif self.layers or self.fit is not None:
            raise ValueError("layers= and fit= need more= (what those layers get).")

    # ------------------------------------------------------------------
    # codecs and settings

    @property
    def rotation(self) -> tuple:
        """(keys, values) rotated?"""
        if self.rotate is not None:
            return ROTATES[self.rotate]
        low = min(self.bits) < 8
        return (low, low)

    @property
    def transform(self) -> tuple:
        """(center, key_scale) as the stores take them: by default keys
        centered and weighted by the queries where they are affine under 8
        bits and first tokens are kept (``first`` not set under 2)."""
        on = self.codec[0] == "affine" and self.bits[0] < 8
        on = on and (self.first is None or self.first >= 2)
        default = ("k", "qk") if on else ("", "")
        given = (self.center, self.key_scale)
        return tuple(d if g is None else g for g, d in zip(given, default))

    @property
    def first_tokens(self) -> int:
        if self.first is not None:
            return self.first
        # centering and key weights are measured on the first tokens
        if any(self.transform):
            return 32
        if min(self.bits) < 8 and "codebook" not in self.codec:
            return 16
        return 0

    def _codec(self, i: int, bits: int):
        if bits == 16:
            return Plain()
        rotation = "hadamard" if self.rotation[i] else "none"
        if self.codec[i] == "codebook":
            debias = self.debias if i == 0 else 0.0
            if self.rotate is None:
                rotation = "hadamard"
            return Codebook(bits, rotation, debias=debias or False)
        return Affine(bits, self.group[i], rotation, self.offset[i])

    def codecs(self, bits=None):
        """The (key, value) codecs."""
        bits = bits or self.bits
        return self._codec(0, bits[0]), self._codec(1, bits[1])

    def codecs_of(self, layer: int):
        """The (key, value) codecs the scheme asks for layer ``layer``."""
        return self.more_codecs() if layer in self.layers else self.codecs()

    def more_codecs(self):
        """The (key, value) codecs of the layers ``more`` names."""
        part = self.more.rstrip("0123456789")
        if part not in ("k", "v", "kv") or part == self.more:
            raise ValueError(f"more={self.more!r}: kB, vB or kvB (e.g. k5).")
        b = int(self.more[len(part) :])
        bits = (b if "k" in part else self.bits[0], b if "v" in part else self.bits[1])
        return self.codecs(bits)

    def settings(self) -> dict:
        """What every layer's store takes besides its codecs."""
        return {
            "center": self.transform[0],
            "key_scale": self.transform[1],
            "first": self.first_tokens,
            "recent": self.recent,
        }

    # ------------------------------------------------------------------
    # caches

    def with_layers(self, layers) -> "KVSpec":
        """The spec with ``fit`` resolved to ``layers``."""
        return replace(self, layers=tuple(sorted(layers)), fit=None)

    def make_cache(self, model, max_kv_size=None) -> list:
        """One cache per layer: the model's own caches quantized as this spec
        says (a sliding-window layer, or every layer with ``max_kv_size``,
        gets a bounded store), or the model's own for ``fp16``. Layers whose
        cache has no quantized form keep it."""
        from mlx_lm.models.cache import make_prompt_cache

        caches = make_prompt_cache(model, max_kv_size)
        if self.bits is None:
            return caches
        if self.fit is not None:
            raise ValueError(
                f"{self}: fit={self.fit:g} needs the model's fitted layers "
                "(omlx_cache.kv.fit.resolve)."
            )
        if self.layers and self.layers[-1] >= len(caches):
            raise ValueError(
                f"{self}: layer {self.layers[-1]} of a model with {len(caches)} layers."
            )
        lists, dequantized = _how_model_reads(model, self, max_kv_size)
        # a bounded store's rows do not carry its sinks: a model that reads
        # them keeps its own bounded caches
        out = self._stores(caches, lists, windows=not dequantized)
        for c in stores(out):
            c.fetch_dequantized = dequantized
        return out

    def stored_shapes(self, model, shapes, max_kv_size=None) -> list:
        """Of ``shapes`` (``layer_shapes(model, max_kv_size)``), those
        ``make_cache`` stores: the bounded layers of a model that reads its
        keys itself keep the model's caches (None here)."""
        if self.bits is None or not _how_model_reads(model, self, max_kv_size)[1]:
            return shapes
        return [None if s is None or s.window is not None else s for s in shapes]

    def _stores(self, caches, lists=True, windows=True) -> list:
        """The model's caches, those with a quantized form as stores (inside
        a ``CacheList`` too, with ``lists``; bounded ones with ``windows``)."""
        return [
            self._store(c, self.codecs_of(i), lists, windows)
            for i, c in enumerate(caches)
        ]

    def _store(self, c, codecs, lists=True, windows=True):
        from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache

        if type(c) is KVCache:
            return KVStore(*codecs, **self.settings())
        if type(c) is RotatingKVCache and windows:
            settings = dict(self.settings(), recent=0)
            return KVStore(*codecs, **settings, window=c.max_size, keep=c.keep)
        if type(c) is CacheList and lists:
            return CacheList(
                *(self._store(x, codecs, windows=windows) for x in c.caches)
            )
        return c

    # ------------------------------------------------------------------
    # the footprint

    def layer_bytes(self, shape, tokens: int, layer: int = 0) -> float:
        """Bytes one layer of ``shape`` (``LayerShape``) holds for a sequence
        of ``tokens`` tokens: the first tokens unquantized (in the first span
        only, allocated whole; the pages begin after them), the pages (scales
        and norms included), the recent ones held unquantized (on average
        over a residual's cycle; the first of them also in the first span),
        and the transform's float32 vectors. A bounded layer's pages hold the
        rows the next query sees besides its sinks (whole pages aside); a
        sliding window (keep 0) lets its first tokens go once it sees none."""
        heads, dims = shape.kv_heads, (shape.key_dim, shape.value_dim)
        if self.bits is None:
            if shape.window is not None:
                tokens = min(tokens, shape.window)
            return tokens * heads * sum(dims) * SCALE_BITS / 8
        codecs = self.layer_codecs(shape, layer)
        held = _mean_held(self.recent if shape.window is None else 0, tokens)
        # the first span is allocated whole at the first write
        first = self.first_tokens if tokens else 0
        if shape.window is None:
            # rows written to the pages, the first tokens skipped
            paged = max(tokens - held - first, 0)
        else:
            first = max(first, shape.keep) if tokens else 0
            paged = max(min(tokens - first, shape.window - shape.keep), 0)
            if not shape.keep and tokens - shape.window + 1 >= first:
                first = 0  # the sliding window's first span went
        bits = 0.0
        for c, dim in zip(codecs, dims):
            bits += (
                paged * c.bits_per_element(dim) + (held + first) * SCALE_BITS
            ) * dim
        center, key_scale = self.transform
        vectors = (center != "") + (center == "kv") + (key_scale != "")
        return heads * (bits / 8 + vectors * 4 * dims[0])

    def layer_codecs(self, shape, layer: int = 0) -> tuple:
        """The (key, value) codecs layer ``layer`` of ``shape`` stores with: a
        head dim a codec cannot store gets a group size that divides it, else
        is stored unquantized (``codecs.for_dim``)."""
        dims = (shape.key_dim, shape.value_dim)
        return tuple(for_dim(c, dim) for c, dim in zip(self.codecs_of(layer), dims))

    def quantized_layers(self, shapes) -> int:
        """Layers of ``shapes`` (None: no quantized form) a part of which is
        quantized."""
        return sum(
            any(not isinstance(c, Plain) for c in self.layer_codecs(shape, i))
            for i, shape in enumerate(shapes)
            if shape is not None
        )

    def fitted_dims(self, shapes) -> list:
        """One line per head dim of ``shapes`` that the scheme's codecs cannot
        store as they are: what its layers get instead, and why."""
        notes = {}
        for i, shape in enumerate(shapes):
            if shape is None:
                continue
            asked = self.codecs_of(i)
            dims = (shape.key_dim, shape.value_dim)
            stored = self.layer_codecs(shape, i)
            for part, c, got, dim in zip(("keys", "values"), asked, stored, dims):
                if got == c:
                    continue
                if isinstance(got, Affine):
                    what = f"group size {got.group_size}"
                    why = f"{c.group_size} does not divide head dim {dim}"
                elif isinstance(c, Affine):
                    what = "unquantized"
                    why = f"no group size up to {c.group_size} divides head dim {dim}"
                else:
                    what, why = "unquantized", why_not(c, dim)
                notes.setdefault((what, why), {}).setdefault(part, []).append(i)
        lines = []
        for (what, why), parts in notes.items():
            layers = sorted({i for found in parts.values() for i in found})
            lines.append(
                f"{' and '.join(parts)} of layers {layer_ranges(layers)}: {what} ({why})"
            )
        return lines

    def footprint(self, shapes, context: int) -> dict:
        """What ``shapes`` (one per layer) hold for ``context`` tokens: bytes,
        bytes per token and (key, value) bits per element."""
        # layers whose caches have no quantized form (None) are left out
        total = sum(self.layer_bytes(s, context, i) for i, s in enumerate(shapes) if s)
        elements = sum(
            min(context, s.window or context) * s.kv_heads * (s.key_dim + s.value_dim)
            for s in shapes
            if s
        )
        return {
            "bytes": total,
            "bytes_per_token": total / context,
            # (no layer stored: a model whose caches all stay its own)
            "bits_per_element": 8 * total / elements if elements else 0.0,
        }


def stores(caches) -> list:
    """The ``KVStore``s among ``caches``, those in a ``CacheList`` too."""
    out = []
    for c in caches:
        if isinstance(c, KVStore):
            out.append(c)
        elif hasattr(c, "caches"):
            out += stores(c.caches)
    return out


_READ_BY = weakref.WeakValueDictionary()
_READS = {}


def _how_model_reads(model, spec, max_kv_size) -> tuple:
    """``(lists, dequantized)``: whether ``model`` runs with stores inside its
    ``CacheList``s, and whether it reads the keys and values its caches
    return (it attends by itself, reads another layer's cache, or projects
    an MLA latent) rather than handing them to the cache's attention. Two
    tokens through fresh caches tell, once per model: stores that return
    their pages (each must see its own attention), else their rows
    dequantized; then the same with the ``CacheList``s as they are (a model
    that writes into a cache's arrays)."""
    from mlx_lm.models.cache import make_prompt_cache

    key = (id(model), max_kv_size)
    if _READ_BY.get(key) is model:
        return _READS[key]
    found = (False, True)
    for lists, dequantized in itertools.product((True, False), (False, True)):
        probe = spec._stores(make_prompt_cache(model, max_kv_size), lists)
        for c in stores(probe):
            c.fetch_dequantized = dequantized
        try:
            mx.eval(model(mx.array([[0, 0]]), cache=probe))
        except Exception:  # noqa: BLE001, S112 (what a model cannot run with)
            continue
        if dequantized or all(c.attended for c in stores(probe)):
            found = (lists, dequantized)
            break
    _READ_BY[key] = model
    _READS[key] = found
    return found


def _items(items) -> dict:
    """Spec fields from ``name=value`` items."""
    fields = {}
    for item in items:
        if item.replace(",", "").isdigit():
            item = f"bits={item}"  # 4, 8,4: as --kv-bits takes them
        name, eq, value = item.partition("=")
        if not eq or not value:
            raise ValueError(f"{item!r}: expected name=value (known: {ITEMS}).")
        if name not in _PARSERS:
            raise ValueError(f"Unknown scheme item {name!r} (known: {ITEMS}).")
        key, parsed = _PARSERS[name](value)
        fields[key] = parsed
    return fields


def _tokens(name, multiple=1):
    def parse(value):
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r}: a number of tokens.") from None
        return name, check_tokens(n, name, multiple)

    return parse


def _number(value, name):
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: a number.") from None


def _choices(value, name, choices):
    return "" if value == "none" else _choice(value, name, (*choices, "none"))


def _choice_pair(value, name, choices) -> tuple:
    """(keys, values) of ``name=K,V`` (or one for both), each one of ``choices``."""
    return tuple(_choice(p, name, choices) for p in _pair(value, name, str))


_PARSERS = {
    "codec": lambda v: ("codec", _choice_pair(v, "codec", CODECS)),
    "bits": lambda v: ("bits", _pair(v, "bits")),
    "group": lambda v: ("group", _pair(v, "group")),
    "offset": lambda v: ("offset", _choice_pair(v, "offset", OFFSETS)),
    "rotate": lambda v: ("rotate", _choice(v, "rotate", tuple(ROTATES))),
    "center": lambda v: ("center", _choices(v, "center", CENTERS)),
    "qscale": lambda v: ("key_scale", _choices(v, "qscale", KEY_SCALES)),
    "first": _tokens("first"),
    "recent": _tokens("recent", 8),
    "debias": lambda v: ("debias", _number(v, "debias")),
    "more": lambda v: ("more", v),
    "layers": lambda v: ("layers", _layers(v)),
    "fit": lambda v: ("fit", _number(v, "fit")),
}
ITEMS = ", ".join(_PARSERS)


def _layers(value):
    try:
        return tuple(sorted({int(x) for x in value.split(",")}))
    except ValueError:
        raise ValueError(f"layers={value!r}: layer numbers, e.g. layers=4,8.") from None


def layer_ranges(numbers) -> str:
    """``0-3,7``: sorted ints as runs."""
    runs = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _mean_held(residual: int, tokens: int) -> float:
    """Tokens a residual of ``residual`` holds unquantized after ``tokens``,
    averaged over a quantization cycle once it has begun (``residual`` to
    ``2 * residual - 1``)."""
    if not residual:
        return 0
    if tokens < 2 * residual:
        return tokens
    return (3 * residual - 1) / 2


@dataclass(frozen=True)
class LayerShape:
    kv_heads: int
    key_dim: int
    value_dim: int
    window: int | None = None  # a bounded layer's tokens at most
    keep: int = 0


def layer_shapes(model, max_kv_size=None, caches=None) -> list:
    """Each layer's KV heads, head dims and window, read off the model's own
    caches (made here unless given, empty) after one token (None: a cache with
    no quantized form)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    if caches is None:
        caches = make_prompt_cache(model, max_kv_size)
    mx.eval(model(mx.array([[0]]), cache=caches))
    shapes = []
    for c in caches:
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if type(c) not in (KVCache, RotatingKVCache) or keys is None:
            shapes.append(None)  # a cache with no quantized form
            continue
        window = getattr(c, "max_size", None)
        keep = getattr(c, "keep", 0)
        shapes.append(
            LayerShape(keys.shape[1], keys.shape[-1], values.shape[-1], window, keep)
        )
    return shapes


def preset_help() -> str:
    return "; ".join(f"{name}: {text}" for name, text in PRESETS.items())
