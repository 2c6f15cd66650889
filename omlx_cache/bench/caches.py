"""Bench scheme names and the caches they make: ``fp16``, upstream's
``upstream-B[@S]``, ours ``B`` / ``K,V`` with ``+reserve``, ``/pN`` and ``/hN``,
and any scheme of ``omlx_cache.schemes`` by name."""

import re
from contextlib import contextmanager
from dataclasses import dataclass

from mlx_lm.models.cache import (
    BatchKVCache,
    BatchQuantizedKVCache,
    KVCache,
    QuantizedKVCache,
    check_kv_quantization,
)

from .. import schemes as kv_schemes

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


def left_padding(batch: int) -> list[int]:
    """The batch's padding (``--batch``): sequence i starts 37 * i tokens in,
    as a batch of prompts of different lengths does."""
    return [37 * i for i in range(batch)]
