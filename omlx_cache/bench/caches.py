"""Bench schemes and the caches they make: ``fp16`` (mlx-lm's own caches),
``upstream-B[@S]`` (the unpatched release's ``QuantizedKVCache``, from token
S on as its ``generate_step`` converts) and any scheme of
``omlx_cache.kv.spec`` (ours: ``8``, ``8,4``, ``4``, ``cq4``, ``bits=4 first=0``...)."""

from contextlib import contextmanager
from dataclasses import dataclass

from mlx_lm.models.cache import BatchKVCache, KVCache

from ..kv.spec import KVSpec
from ..kv.store import BatchKVStore, KVStore

DEFAULT_SCHEMES = (
    "fp16",
    "upstream-8",
    "upstream-4",
    "upstream-4@5000",
    "8",
    "8,4",
    "4",
)


@dataclass(frozen=True)
class Scheme:
    name: str
    kind: str  # "fp", "upstream" or "ours"
    bits: tuple[int, int] = (16, 16)
    quantized_start: int = 0
    spec: KVSpec | None = None

    @property
    def counterpart(self) -> str | None:
        """The upstream scheme that ours is compared with: the smaller of its
        (key, value) bits, for plain affine specs."""
        if self.kind != "ours" or "codebook" in self.spec.codec:
            return None
        return f"upstream-{min(self.bits)}"


def parse_scheme(name: str) -> Scheme:
    if name == "fp16":
        return Scheme(name, "fp")
    if name.startswith("upstream-"):
        bits, _, start = name.removeprefix("upstream-").partition("@")
        spec = KVSpec.parse(f"bits={bits}")
        return Scheme(name, "upstream", spec.bits, quantized_start=int(start or 0))
    spec = KVSpec.parse(name)
    if spec.fit is not None:
        raise ValueError(
            f"{name}: the bench makes caches without a model; use layers=."
        )
    return Scheme(name, "ours", spec.bits, spec=spec)


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
    return setting(KVStore, "page_size", size)


def _stores(spec: KVSpec, n_layers: int, make):
    return [make(*spec.codecs_of(i), **spec.settings()) for i in range(n_layers)]


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
        return make_batch_cache(scheme, n_layers, batch)
    if scheme.kind == "fp":
        return [KVCache() for _ in range(n_layers)]
    if scheme.kind == "upstream":
        if scheme.quantized_start:
            return [upstream.KVCache() for _ in range(n_layers)]
        bits = scheme.bits[0]
        return [upstream.QuantizedKVCache(group_size, bits) for _ in range(n_layers)]
    cache = _stores(scheme.spec, n_layers, KVStore)
    for c in cache:
        # as generate_step reserves the generation's page
        c.reserve = tokens
    return cache


def make_batch_cache(scheme: Scheme, n_layers: int, batch: int):
    """The caches of mlx-lm's batched generation (``BatchGenerator``): left
    padding, the mask that drops it."""
    padding = left_padding(batch)
    if scheme.kind == "fp":
        return [BatchKVCache(padding) for _ in range(n_layers)]
    if scheme.kind == "ours":
        return _stores(
            scheme.spec,
            n_layers,
            lambda *codecs, **kw: BatchKVStore(padding, *codecs, **kw),
        )
    raise ValueError(f"--batch takes fp16 and our schemes, not {scheme.name}")


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
