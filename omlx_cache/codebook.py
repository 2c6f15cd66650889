"""A 3- or 4-bit codebook KV cache (TurboQuant / PlanarQuant style).

Each key or value vector (one head, length D) is stored as its L2 norm in
float16 and, for each of its D coordinates after an orthogonal rotation, a
b-bit index into a Lloyd-Max codebook. A rotated unit vector's coordinates
are close to N(0, 1/D) whatever the input, so one fixed codebook (the
Lloyd-Max levels of a unit Gaussian, scaled by 1/sqrt(D)) fits every head and
layer without calibration. Indices are packed densely (32 three-bit indices
in 3 uint32 words, as sign and magnitude for the CUDA kernels of
``codebook_kernel``), so an element costs b + 16/D bits: 3.125 at D = 128.

The cache is paged like mlx-lm's ``QuantizedKVCache``: vectors are encoded
once, as they arrive, into pages allocated once and written in place. It
attends over its own pages: one tile of keys at a time is decoded into the
rotated domain (indices -> codebook levels -> times the norms), the queries are
rotated once instead of the keys, the values are accumulated in their rotated
domain and the output is rotated back once. The softmax is online (running
maximum and sum in float32), so only one tile is ever dequantized.

Keys and values each have a codec: ``Codebook`` (the above), ``Affine``
(mlx's affine quantization, optionally rotated) or ``Plain`` (unquantized,
for measuring K-only or V-only error).
"""

import math
import re
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np
from mlx_lm.models import base
from mlx_lm.models.base import (
    _float_tile,
    _fold_queries,
    _quantized_sdpa_tile,
    _quantized_sdpa_tile_mask,
    _quantized_sdpa_tiles,
    _without_positions,
)
from mlx_lm.models.cache import (
    BatchKVCache,
    _BaseCache,
    _BatchExactKV,
    _PagedKV,
    _QuantizedKV,
    check_kv_quantization,
    create_attention_mask,
    dynamic_roll,
    kv_rotate,
    register_cache_class,
)

from .center import _Centering, _KeyWeighting, check_center_state

ROTATIONS = ("hadamard", "givens", "none")
# how the stored norm scales the decoded unit vector (see ``Codebook``)
NORMS = ("dot", "length", "plain")
NORM_BITS = 16
# an 8-bit norm (``Codebook(norm_bits=8)``) is log2 of the float norm in steps
# of NORM8_STEP octaves from 2**NORM8_LOW: 256 steps span 2**-10 to 2**14,
# relative error at most 3.3% (1.9% rms), a few percent of a 3-bit code's
NORM8_LOW = -10.0
NORM8_STEP = 3 / 32


# ---------------------------------------------------------------------------
# Lloyd-Max codebook of a unit Gaussian


def _gaussian_pdf(x):
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _gaussian_cdf(x):
    return 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _cells(levels):
    """Lower and upper edges of the nearest-level cells."""
    edges = np.concatenate([[-np.inf], (levels[1:] + levels[:-1]) / 2, [np.inf]])
    return edges[:-1], edges[1:]


def gaussian_mse(levels) -> float:
    """Mean squared error of rounding a unit Gaussian to the nearest level."""
    lo, hi = _cells(np.asarray(levels, np.float64))
    p = _gaussian_cdf(hi) - _gaussian_cdf(lo)
    # x * pdf(x) is 0 at +-inf: take x as 0 there rather than inf * 0
    lo_pdf = np.where(np.isinf(lo), 0, lo) * _gaussian_pdf(lo)
    hi_pdf = np.where(np.isinf(hi), 0, hi) * _gaussian_pdf(hi)
    second = p + lo_pdf - hi_pdf  # E[x^2 ; cell]
    first = _gaussian_pdf(lo) - _gaussian_pdf(hi)  # E[x ; cell]
    return float(np.sum(second - 2 * levels * first + levels**2 * p))


@lru_cache
def lloyd_max(bits: int, tol: float = 1e-12, max_iter: int = 100_000):
    """The 2**bits Lloyd-Max levels of a unit Gaussian (ascending, as a tuple)
    and their mean squared error, by Lloyd's algorithm on the exact density:
    each level moves to the mean of its cell until none moves by ``tol``."""
    levels = np.linspace(-2.0, 2.0, 1 << bits)
    for _ in range(max_iter):
        lo, hi = _cells(levels)
        p = _gaussian_cdf(hi) - _gaussian_cdf(lo)
        new = (_gaussian_pdf(lo) - _gaussian_pdf(hi)) / p
        done = np.max(np.abs(new - levels)) < tol
        levels = new
        if done:
            break
    return tuple(levels.tolist()), gaussian_mse(levels)


@lru_cache
def _levels(bits: int, dim: int, dtype) -> mx.array:
    """Codebook levels for the coordinates of a rotated unit vector of ``dim``."""
    levels, _ = lloyd_max(bits)
    return (mx.array(levels) / math.sqrt(dim)).astype(dtype)


@lru_cache
def _thresholds(bits: int) -> mx.array:
    """Cell edges between the unit-Gaussian levels."""
    levels = np.array(lloyd_max(bits)[0])
    return mx.array((levels[1:] + levels[:-1]) / 2, dtype=mx.float32)


# ---------------------------------------------------------------------------
# Rotations


@lru_cache
def _givens_angles(dim: int):
    """Cosines and sines of the fixed random angles of the D/2 plane rotations."""
    theta = np.random.default_rng(dim).uniform(0, 2 * np.pi, dim // 2)
    return mx.array(np.cos(theta), mx.float32), mx.array(np.sin(theta), mx.float32)


def givens_rotate(x: mx.array, inverse: bool = False) -> mx.array:
    """Rotate each pair of coordinates (2i, 2i + 1) of the last axis by its own
    fixed random angle (PlanarQuant's block-diagonal rotation), or back."""
    cos, sin = _givens_angles(x.shape[-1])
    if inverse:
        sin = -sin
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    out = mx.stack([cos * a - sin * b, sin * a + cos * b], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def rotate(x: mx.array, rotation: str, inverse: bool = False) -> mx.array:
    """Apply the named orthogonal rotation to the last axis of ``x`` (or undo it)."""
    if rotation == "hadamard":
        return kv_rotate(x, inverse=inverse)
    if rotation == "givens":
        return givens_rotate(x, inverse=inverse)
    return x


def _check_rotation(rotation: str):
    if rotation not in ROTATIONS:
        raise ValueError(f"Unknown rotation {rotation!r}; one of {ROTATIONS}.")


# ---------------------------------------------------------------------------
# Dense bit packing


@lru_cache
def _layout(bits: int):
    """How ``bits``-bit indices lie in uint32 words: a block of ``per`` indices
    fills ``words`` words exactly; index i starts at bit ``shift[i]`` of word
    ``word[i]`` and spills into the next word when ``spill[i]``."""
    per = 32 // math.gcd(bits, 32)
    words = per * bits // 32
    start = np.arange(per) * bits
    word, shift = start // 32, start % 32
    spill = shift + bits > 32
    # the low bits of a spilling index go to ``word``, the rest to word + 1
    back = np.where(spill, 32 - shift, 0)

    def onehot(w):
        return mx.array(np.arange(words) == w[:, None], mx.uint32)

    return {
        "per": per,
        "words": words,
        "word": mx.array(word, mx.uint32),
        "next": mx.array(np.minimum(word + 1, words - 1), mx.uint32),
        "shift": mx.array(shift, mx.uint32),
        "back": mx.array(back, mx.uint32),
        "spill": mx.array(spill, mx.uint32),
        "to_word": onehot(word),
        "to_next": onehot(word + 1),
    }


def sign_magnitude_3bit():
    """Where element r (0..31) of a block of 32 three-bit indices lies in the
    block's 3 words: (magnitude word, magnitude shift, sign shift); word 2
    holds the signs. The index's sign is ``idx >= 4`` and its magnitude (two
    bits) counts levels away from zero. Two elements four apart share a pair
    of bytes (shifts 16 kk + 2 j and 16 kk + 8 + 2 j) and have their signs at
    bits P and P + 16, so that a decoder makes a pair of halves from one
    shift-and-mask, one byte permute and one shift (``codebook_kernel``)."""
    r = np.arange(32)
    mw, h = r // 16, r % 16
    k, j = h // 4, h % 4
    pair = mw * 8 + (k // 2) * 4 + j
    return mw, 8 * k + 2 * j, pair + 16 * (k % 2)


@lru_cache
def _layout3():
    mw, mag_shift, sign_shift = sign_magnitude_3bit()
    return {
        "mag_word": mx.array(mw, mx.uint32),
        "mag_shift": mx.array(mag_shift, mx.uint32),
        "sign_shift": mx.array(sign_shift, mx.uint32),
        "to_word": mx.array(np.arange(2) == mw[:, None], mx.uint32),
    }


def split_5bit():
    """Where the high bit of element r (0..31) of a block of 32 five-bit
    indices lies in the block's word 4; words 0-3 hold the low four bits as
    4-bit packing does (element r at bit 4 (r % 8) of word r // 8). The high
    bits of r and r + 4, which share a byte of a low word, are 16 bits apart
    (4 (r // 8) + r % 4 and 16 more), so that a decoder gets a pair of
    indices from two shift-and-masks (``codebook_kernel``)."""
    r = np.arange(32)
    return 16 * ((r % 8) // 4) + 4 * (r // 8) + r % 4


def packed_dim(dim: int, bits: int) -> int:
    """uint32 words holding ``dim`` indices of ``bits`` bits."""
    per = _layout(bits)["per"]
    if dim % per:
        raise ValueError(f"{bits}-bit packing needs a multiple of {per}, got {dim}.")
    return dim * bits // 32


def pack(indices: mx.array, bits: int) -> mx.array:
    """Pack the last axis of ``indices`` (each < 2**bits) into uint32 words with
    no unused bit: (..., D) -> (..., D * bits / 32). Three-bit indices are
    stored as sign and magnitude (``sign_magnitude_3bit``), five-bit ones as
    their low four bits and their high bits (``split_5bit``), other widths
    densely in order, an index spilling into the next word where it must."""
    if bits == 3:
        return _pack3(indices)
    if bits == 5:
        return _pack5(indices)
    lay = _layout(bits)
    dim = indices.shape[-1]
    words = packed_dim(dim, bits)
    blocks = indices.astype(mx.uint32).reshape(-1, dim // lay["per"], lay["per"], 1)
    low = blocks << lay["shift"][:, None]
    high = (blocks >> lay["back"][:, None]) * lay["spill"][:, None]
    # the bits of different indices never overlap: a sum is an OR
    out = (low * lay["to_word"]).sum(axis=-2) + (high * lay["to_next"]).sum(axis=-2)
    return out.reshape(*indices.shape[:-1], words)


def unpack(packed: mx.array, bits: int) -> mx.array:
    """The uint32 indices that ``pack`` packed: (..., W) -> (..., W * 32 / bits)."""
    if bits == 3:
        return _unpack3(packed)
    if bits == 5:
        return _unpack5(packed)
    lay = _layout(bits)
    words = packed.shape[-1]
    blocks = packed.reshape(*packed.shape[:-1], words // lay["words"], lay["words"])
    low = mx.take(blocks, lay["word"], axis=-1) >> lay["shift"]
    high = (mx.take(blocks, lay["next"], axis=-1) << lay["back"]) * lay["spill"]
    indices = (low | high) & ((1 << bits) - 1)
    return indices.reshape(*packed.shape[:-1], words * 32 // bits)


def _pack3(indices: mx.array) -> mx.array:
    lay = _layout3()
    dim = indices.shape[-1]
    words = packed_dim(dim, 3)
    blocks = indices.astype(mx.uint32).reshape(-1, dim // 32, 32)
    sign = blocks >> 2
    # magnitude: 0 for the levels next to zero, 3 for the outermost
    magnitude = (blocks & 3) ^ ((sign ^ 1) * 3)
    mags = ((magnitude << lay["mag_shift"])[..., None] * lay["to_word"]).sum(axis=-2)
    signs = (sign << lay["sign_shift"]).sum(axis=-1, keepdims=True)
    out = mx.concatenate([mags, signs], axis=-1)
    return out.reshape(*indices.shape[:-1], words)


def _unpack3(packed: mx.array) -> mx.array:
    lay = _layout3()
    words = packed.shape[-1]
    blocks = packed.reshape(*packed.shape[:-1], words // 3, 3)
    mags = mx.take(blocks, lay["mag_word"], axis=-1) >> lay["mag_shift"]
    sign = (blocks[..., 2:3] >> lay["sign_shift"]) & 1
    indices = (sign << 2) | ((mags & 3) ^ ((sign ^ 1) * 3))
    return indices.reshape(*packed.shape[:-1], words * 32 // 3)


@lru_cache
def _high_shift5():
    return mx.array(split_5bit(), mx.uint32)


def _pack5(indices: mx.array) -> mx.array:
    dim = indices.shape[-1]
    words = packed_dim(dim, 5)
    blocks = indices.astype(mx.uint32).reshape(-1, dim // 32, 32)
    low = pack(blocks & 15, 4)
    high = ((blocks >> 4) << _high_shift5()).sum(axis=-1, keepdims=True)
    out = mx.concatenate([low, high], axis=-1)
    return out.reshape(*indices.shape[:-1], words)


def _unpack5(packed: mx.array) -> mx.array:
    words = packed.shape[-1]
    blocks = packed.reshape(*packed.shape[:-1], words // 5, 5)
    low = unpack(blocks[..., :4], 4)
    high = (blocks[..., 4:] >> _high_shift5()) & 1
    indices = low | (high << 4)
    return indices.reshape(*packed.shape[:-1], words * 32 // 5)


# ---------------------------------------------------------------------------
# Codecs: how one tensor (keys or values) is stored


def _zeros(x: mx.array, size: int, *widths):
    """Zero arrays (B, n_kv_heads, size, width) for each ``(width, dtype)``."""
    B, n_kv_heads = x.shape[:2]
    return tuple(mx.zeros((B, n_kv_heads, size, w), dtype) for w, dtype in widths)


@dataclass(frozen=True)
class Codebook:
    """``bits``-bit Lloyd-Max codebook on rotated unit vectors plus a float16 norm.

    ``norm`` is what the stored float16 scalar makes of the decoded unit
    vector ``c`` (the codebook levels) for an input ``x = |x| u``:

    - ``"dot"``: ``|x| / <u, c>``, so the decoded vector's component along
      ``x`` is exact and dot products with it are unbiased (quantizing to the
      nearest level shrinks the vector along itself by about the MSE);
    - ``"length"``: ``|x| / |c|``, the decoded vector has the input's length;
    - ``"plain"``: ``|x|``.

    ``norm_bits`` is how that scalar is stored: 16 (float16) or 8 (uint8,
    log2 of it in steps of ``NORM8_STEP`` octaves: ``encode_norm``), which
    saves 0.125 bits per element at head dim 64.

    ``debias`` (keys): attention takes half the expected variance of each
    decoded key's score error off its score. A score with independent error
    of variance v weighs exp(v / 2) times its own on average, so keys with
    larger norms (larger errors) would gain weight over the others, and
    every quantized key over the kept, unquantized ones (``error_variance``).
    A number instead of ``True`` scales the correction (2: twice it), for
    measuring what its size does.
    """

    bits: int = 3
    rotation: str = "hadamard"
    norm: str = "dot"
    norm_bits: int = NORM_BITS
    debias: bool | float = False
    parts = 2  # arrays per page: packed indices, norms

    def __post_init__(self):
        if not 1 <= self.bits <= 6:
            raise ValueError(f"Codebook bits must be 1 to 6, got {self.bits}.")
        _check_rotation(self.rotation)
        if self.norm not in NORMS:
            raise ValueError(f"Unknown norm {self.norm!r}; one of {NORMS}.")
        if self.norm_bits not in (8, NORM_BITS):
            raise ValueError(
                f"Codebook norm_bits must be 8 or 16, got {self.norm_bits}."
            )
        if self.debias < 0:
            raise ValueError(f"Codebook debias must be 0 or more, got {self.debias}.")

    @property
    def spec(self) -> str:
        spec = f"codebook-{self.bits}-{self.rotation}-{self.norm}"
        if self.norm_bits != NORM_BITS:
            spec += f"-n{self.norm_bits}"
        if not self.debias:
            return spec
        return f"{spec}-debias" + ("" if self.debias == 1 else f"{self.debias:g}")

    @property
    def relative_error(self) -> float:
        """The expected squared error of a decoded vector over its stored
        norm squared: a coordinate's quantization keeps ``1 - mse`` of its
        energy (Lloyd-Max levels are their cells' means), so the decoded
        unit vector ``c`` has ``|c|^2 ~ <u, c> ~ 1 - mse``. ``"dot"``'s
        error is orthogonal to the input: ``|c|^2 - <u, c>^2``; ``"length"``
        rescales ``c`` to the input's length, about the same; ``"plain"``
        keeps the codebook's ``mse``."""
        mse = lloyd_max(self.bits)[1]
        return mse if self.norm == "plain" else mse * (1 - mse)

    def error_variance(self, norms: mx.array, dim: int) -> mx.array:
        """The expected float32 squared error per coordinate of the vectors
        whose stored ``norms`` these are (the error spreads evenly over the
        rotated coordinates)."""
        if norms.dtype == mx.uint8:
            norms = decode_norm(norms)
        norms = norms.astype(mx.float32)
        return norms * norms * (self.relative_error / dim)

    def bits_per_element(self, dim: int) -> float:
        return self.bits + self.norm_bits / dim

    def check_dim(self, dim: int):
        packed_dim(dim, self.bits)
        if self.rotation == "givens" and dim % 2:
            raise ValueError(f"Givens rotation needs an even head dim, got {dim}.")

    def dim(self, page) -> int:
        return page[0].shape[-1] * 32 // self.bits

    def empty_page(self, x: mx.array, size: int):
        dim = packed_dim(x.shape[-1], self.bits)
        norm = mx.float16 if self.norm_bits == NORM_BITS else mx.uint8
        return _zeros(x, size, (dim, mx.uint32), (1, norm))

    def encode(self, x: mx.array):
        """(packed indices, float16 norms) of the vectors on the last axis."""
        if codebook_kernel.encodes(x, self):
            return codebook_kernel.encode(x, self)
        dim = x.shape[-1]
        x = rotate(x.astype(mx.float32), self.rotation)
        length = mx.sqrt((x * x).sum(axis=-1, keepdims=True))
        unit = x / mx.maximum(length, 1e-30)
        cells = unit[..., None] * math.sqrt(dim) > _thresholds(self.bits)
        indices = cells.astype(mx.uint32).sum(axis=-1)
        if self.norm == "plain":
            norm = length
        else:
            decoded = _levels(self.bits, dim, mx.float32)[indices]
            if self.norm == "dot":
                scale = (unit * decoded).sum(axis=-1, keepdims=True)
            else:
                scale = mx.sqrt((decoded * decoded).sum(axis=-1, keepdims=True))
            norm = length / mx.maximum(scale, 1e-30)
        if self.norm_bits == 8:
            return pack(indices, self.bits), encode_norm(norm)
        norm = mx.minimum(norm, float(np.finfo(np.float16).max))
        return pack(indices, self.bits), norm.astype(mx.float16)

    def decode(self, page, dtype) -> mx.array:
        """The stored vectors, in the rotated domain."""
        packed, norms = page
        levels = _levels(self.bits, self.dim(page), dtype)
        if norms.dtype == mx.uint8:
            norms = decode_norm(norms)
        return levels[unpack(packed, self.bits)] * norms.astype(dtype)


def encode_norm(norm: mx.array) -> mx.array:
    """Float norms as 8-bit codes: log2 in steps of ``NORM8_STEP`` octaves
    from ``2**NORM8_LOW``, rounded to the nearest (clipped to 0..255)."""
    log = mx.log2(mx.maximum(norm.astype(mx.float32), 1e-30))
    code = mx.round((log - NORM8_LOW) / NORM8_STEP)
    return mx.clip(code, 0, 255).astype(mx.uint8)


def decode_norm(code: mx.array) -> mx.array:
    """The float32 norms of 8-bit codes (``encode_norm``)."""
    return mx.power(2.0, code.astype(mx.float32) * NORM8_STEP + NORM8_LOW)


@dataclass(frozen=True)
class Affine:
    """mlx's affine quantization (``mx.quantize``), after an optional rotation."""

    bits: int = 4
    group_size: int = 64
    rotation: str = "hadamard"
    parts = 3  # arrays per page: packed, scales, biases

    def __post_init__(self):
        check_kv_quantization(self.group_size, self.bits)
        _check_rotation(self.rotation)

    @property
    def spec(self) -> str:
        return f"affine-{self.bits}-{self.group_size}-{self.rotation}"

    def bits_per_element(self, dim: int) -> float:
        return self.bits + 2 * NORM_BITS / self.group_size

    def check_dim(self, dim: int):
        if dim % self.group_size:
            raise ValueError(f"Head dim {dim} is not a multiple of {self.group_size}.")

    def dim(self, page) -> int:
        return page[0].shape[-1] * 32 // self.bits

    def empty_page(self, x: mx.array, size: int):
        dim, groups = x.shape[-1] * self.bits // 32, x.shape[-1] // self.group_size
        return _zeros(x, size, (dim, mx.uint32), (groups, x.dtype), (groups, x.dtype))

    def encode(self, x: mx.array):
        x = rotate(x, self.rotation)
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def decode(self, page, dtype) -> mx.array:
        x = mx.dequantize(*page, group_size=self.group_size, bits=self.bits)
        return x.astype(dtype)


@dataclass(frozen=True)
class Plain:
    """Unquantized, in the model's dtype: for measuring K-only or V-only error."""

    rotation = "none"
    spec = "plain"
    parts = 1

    def bits_per_element(self, dim: int) -> float:
        return 16.0

    def check_dim(self, dim: int):
        pass

    def dim(self, page) -> int:
        return page[0].shape[-1]

    def empty_page(self, x: mx.array, size: int):
        return _zeros(x, size, (x.shape[-1], x.dtype))

    def encode(self, x: mx.array):
        return (x,)

    def decode(self, page, dtype) -> mx.array:
        return page[0].astype(dtype)


def codec(spec) -> Codebook | Affine | Plain:
    """A codec from itself, an int (codebook bits) or its ``spec`` string."""
    if isinstance(spec, (Codebook, Affine, Plain)):
        return spec
    if isinstance(spec, int):
        return Codebook(spec)
    if spec == "plain":
        return Plain()
    match = re.fullmatch(
        r"codebook-(\d+)-([a-z]+)-([a-z]+)(-n(\d+))?(-debias([\d.]+)?)?", spec
    )
    if match:
        norm_bits = int(match[5] or NORM_BITS)
        debias = float(match[7]) if match[7] else bool(match[6])
        return Codebook(int(match[1]), match[2], match[3], norm_bits, debias)
    match = re.fullmatch(r"affine-(\d+)-(\d+)-(\w+)", spec)
    if match:
        return Affine(int(match[1]), int(match[2]), match[3])
    raise ValueError(f"Unknown KV codec {spec!r}.")


# ---------------------------------------------------------------------------
# Attention over encoded pages


def codebook_scaled_dot_product_attention(
    queries: mx.array,
    key_pages: list,
    value_pages: list,
    key_codec,
    value_codec,
    scale: float,
    mask,
    sinks=None,
    length=None,
    tile=None,
    exact=None,
) -> mx.array:
    """Attention of ``queries`` (B, n_q_heads, L, D) over the first ``length``
    keys and values of the pages (all by default), ``tile`` keys at a time (by
    default as many as keep the scores of a tile within mlx-lm's budget).

    Tiles are decoded into the codecs' rotated domains; the queries are
    rotated once and the output rotated back once. ``sinks`` (one logit per
    query head, or per query: shape (B, n_q_heads, L)) join every softmax as
    a key with no value. ``exact`` (keys, values, first, count), as in
    mlx-lm's quantized attention (patch 0018): unquantized copies, in the
    codecs' rotated domains, of the ``count`` tokens from position ``first``
    (an int, or one per sequence: shape (B,)), attended first in float32
    in place of their encoded copies, which are masked."""
    B, n_q_heads, L, _ = queries.shape
    n_kv_heads = key_pages[0][0].shape[1]
    if length is None:
        length = sum(page[0].shape[2] for page in key_pages)
    dtype = queries.dtype

    queries = rotate(queries, key_codec.rotation)
    queries = _fold_queries(queries * scale, n_kv_heads)
    rows = queries.shape[2]
    # half a score's expected error variance is |q|^2 / 2 times the key's
    # expected squared error per coordinate (``Codebook.debias``)
    half_energy = None
    if getattr(key_codec, "debias", False):
        half_energy = 0.5 * float(key_codec.debias)
        half_energy = half_energy * mx.square(queries.astype(mx.float32)).sum(-1, True)
    # the output and, in its last column, the softmax's running sum: one
    # chain of results, so a tile's probabilities can go before the next
    # tile's scores exist (as in mlx-lm's quantized attention)
    if sinks is None:
        running_max = mx.full((B, n_kv_heads, rows, 1), -float("inf"), mx.float32)
        carry = None
    else:
        sinks = sinks.astype(mx.float32)
        if sinks.ndim == 1:
            sinks = sinks[:, None]
        sinks = mx.broadcast_to(sinks, (B, n_q_heads, L))[..., None]
        running_max = _fold_queries(sinks, n_kv_heads)
        carry = mx.concatenate(
            [
                mx.zeros((B, n_kv_heads, rows, value_codec.dim(value_pages[0]))),
                mx.ones((B, n_kv_heads, rows, 1)),
            ],
            axis=-1,
        )
    skip = 0
    if exact is not None:
        keys, values, first, count = exact
        if isinstance(first, int):
            positions = first + mx.arange(count)
            skip = first + count
        else:
            positions = first[:, None] + mx.arange(count)
        heads = (L, n_q_heads, n_kv_heads)
        running_max, carry = _float_tile(
            queries,
            keys[..., :count, :],
            values[..., :count, :],
            positions,
            mask,
            length,
            length,
            *heads,
            (running_max, carry),
        )
        if not isinstance(first, int):
            mask = _without_positions(mask, first, count, length, L)
    page_start = 0
    for k_page, v_page in zip(key_pages, value_pages):
        size = min(k_page[0].shape[2], length - page_start)
        if size <= 0:
            break
        keys_per_tile = tile or _quantized_sdpa_tile(B * n_q_heads * L, size)
        for start, new, stop in _quantized_sdpa_tiles(size, size, keys_per_tile):
            keys = key_codec.decode([x[:, :, start:stop] for x in k_page], dtype)
            scores = (queries @ keys.swapaxes(-1, -2)).astype(mx.float32)
            if half_energy is not None:
                norms = k_page[1][:, :, start:stop]
                variance = key_codec.error_variance(norms, keys.shape[-1])
                scores = scores - half_energy * variance.swapaxes(-1, -2)
            tile_mask = _quantized_sdpa_tile_mask(
                mask,
                page_start + start,
                page_start + new,
                page_start + stop,
                length,
                L,
                n_q_heads,
                n_kv_heads,
                skip,
            )
            if tile_mask is not None:
                if tile_mask.dtype == mx.bool_:
                    scores = mx.where(tile_mask, scores, -float("inf"))
                else:
                    scores = scores + tile_mask
            new_max = mx.maximum(running_max, scores.max(axis=-1, keepdims=True))
            # a row with no visible key yet keeps a zero correction, not NaN
            safe_max = mx.where(new_max == -float("inf"), 0, new_max)
            probs = mx.exp(scores - safe_max)
            correction = mx.exp(running_max - safe_max)
            values = value_codec.decode([x[:, :, start:stop] for x in v_page], dtype)
            tile_out = mx.concatenate(
                [
                    (probs.astype(dtype) @ values).astype(mx.float32),
                    probs.sum(axis=-1, keepdims=True),
                ],
                axis=-1,
            )
            carry = tile_out if carry is None else carry * correction + tile_out
            running_max = new_max
            if L > 1 and scores.size >= base.quantized_sdpa_tile_scores() // 64:
                # finish a prefill tile before the next begins, or lazily
                # every tile's scores would exist at once
                mx.eval(carry, running_max)
        page_start += k_page[0].shape[2]
    out = carry[..., :-1] / mx.maximum(carry[..., -1:], 1e-30)
    out = out.astype(dtype).reshape(B, n_q_heads, L, -1)
    return rotate(out, value_codec.rotation, inverse=True)


def _with_exact(x: mx.array, kept: mx.array, first) -> mx.array:
    """``x`` (B, heads, T, D) with its rows ``first`` (an int or (B,)) to
    ``first + n`` replaced by ``kept`` (B, heads, n, D)."""
    n, T = kept.shape[2], x.shape[2]
    first = mx.array(first).reshape(-1, 1)
    onehot = mx.arange(T)[None, :, None] == (first + mx.arange(n))[:, None, :]
    onehot = onehot[:, None].astype(mx.float32)  # (B or 1, 1, T, n)
    placed = onehot @ kept.astype(mx.float32)
    return mx.where(onehot.sum(axis=-1, keepdims=True) > 0, placed, x).astype(x.dtype)


# ---------------------------------------------------------------------------
# Caches


class _CodebookKV(_Centering, _KeyWeighting, _PagedKV):
    """Codecs, paging and attention shared by the single and batched caches.

    ``keys`` and ``values`` are codecs, ints (codebook bits) or codec specs;
    ``values`` defaults to the key codec. ``center`` (``"k"`` or ``"kv"``)
    stores keys (and values) minus their per-head mean of the first write
    (``omlx_cache.center``). ``keep_exact`` (a number of tokens) also keeps
    the first tokens of every sequence unquantized, as mlx-lm's quantized
    caches do (patch 0018): ``exact_keys`` and ``exact_values`` hold them as
    encoded (centered, rotated by their codec's rotation, in the model's
    dtype) and attention reads them instead of their encoded copies.
    ``key_scale`` (``"q"``, ``"qk"``; True is ``"qk"``) stores keys scaled
    channel by channel by ``key_weights`` (``query_key_weights``: set from
    the queries, and with ``"qk"`` the keys, of the first write, which waits
    for the first attention call) and divides the queries by them: more of
    the codebook's precision goes to the channels the queries weigh."""

    page_size = 4096
    keep_exact = 0
    exact_keys = None
    exact_values = None
    # the first write, held until attention's queries set the key weights:
    # (keys, values, position, (start, stop) of each sequence's tokens)
    _pending = None
    # Decode tokens held unquantized for the CUDA decode kernel, as patch
    # 0009's ``QuantizedKVCache.decode_buffer``: a step writes two slices
    # instead of encoding keys and values and writing four. They are centered
    # (and weighted) like the stored tokens but not rotated, and encoded into
    # the pages when a token comes to a full buffer and before anything else
    # reads the pages. None: 32 where the kernel runs
    # (``codebook_kernel.holds``), else none.
    decode_buffer = None
    held_keys = held_values = None
    # set by mlx-lm's ``generate.reserve_quantized_cache`` (as for
    # ``QuantizedKVCache``): the first page holds the whole generation, so a
    # decode call gives the kernel one page, not one per 4,096 tokens (each
    # array a launch takes costs the host, patch 0010)
    reserve = None
    n_held = 0
    # The last held token, as the model made it, while it is not yet in the
    # buffer: the decode kernel centers and weighs it and writes it there
    # (its output replaces the buffer), which saves a decode step the slice
    # writes and the transforms' ops, graph nodes a layer. False: written as
    # it comes (to compare).
    incoming = None
    kernel_writes_held = True

    def _write_pages(self, keys, values, offset, page_size, transformed=False):
        if self.reserve and not self.key_pages:
            # a multiple of 16 tokens keeps the decode kernel's tiles in a page
            self._add_page(keys, values, -(-self.reserve // 16) * 16)
        super()._write_pages(keys, values, offset, page_size, transformed)

    def _land_incoming(self):
        """Write the incoming held token into the buffer."""
        if self.incoming is None:
            return
        keys, values = self._weighted(*self._center(*self.incoming))
        self.incoming = None
        n = self.n_held - 1
        self.held_keys[:, :, n : n + 1] = keys
        self.held_values[:, :, n : n + 1] = values

    def _flush_held(self):
        """Encode the held decode tokens into the pages."""
        self._land_incoming()
        n = self.n_held
        if not n:
            return
        self.n_held = 0
        keys, values = (x[:, :, :n] for x in (self.held_keys, self.held_values))
        start = self._length() - n
        self._write_pages(keys, values, start, self.page_size, transformed=True)

    @property
    def _held_nbytes(self):
        if self.held_keys is None:
            return 0
        return self.held_keys.nbytes + self.held_values.nbytes

    # patch 0018's bookkeeping of the kept tokens, shared with mlx-lm's
    # quantized caches (a single sequence; batches take _BatchExactKV's)
    _exact_rows = _QuantizedKV._exact_rows
    _keep_exact_tokens = _QuantizedKV._keep_exact_tokens
    _exact_count = _QuantizedKV._exact_count
    _exact_first = _QuantizedKV._exact_first
    _exact_state = _QuantizedKV._exact_state
    _set_exact_state = _QuantizedKV._set_exact_state
    _exact_nbytes = _QuantizedKV._exact_nbytes

    def _set_codecs(
        self,
        keys,
        values=None,
        page_size=None,
        center="",
        keep_exact=0,
        key_scale="",
        key_weights=None,
    ):
        self.key_codec = codec(keys)
        self.value_codec = codec(keys if values is None else values)
        self.page_size = int(page_size or type(self).page_size)
        self._set_center(center)
        self._set_exact_state(keep_exact)
        self._set_key_scale(key_scale, key_weights)
        self._pending = None

    def _settings(self) -> dict:
        """What caches must share to be batched (the page size need not)."""
        return {
            "keys": self.key_codec,
            "values": self.value_codec,
            "center": self.center,
            "keep_exact": self.keep_exact,
            "key_scale": self.key_scale,
        }

    @property
    def bits_per_element(self):
        """(key, value) bits per element for this cache's head dims, norms,
        scales and biases included; None before the first tokens."""
        if not self.key_pages:
            return None
        return tuple(
            c.bits_per_element(c.dim(pages[0]))
            for c, pages in (
                (self.key_codec, self.key_pages),
                (self.value_codec, self.value_pages),
            )
        )

    def _add_page(self, keys, values, size):
        self.key_pages.append(self.key_codec.empty_page(keys, size))
        self.value_pages.append(self.value_codec.empty_page(values, size))

    def _quantize_at(self, keys, values, offset, transformed=False):
        """Encode ``keys`` and ``values`` that go to position ``offset`` on,
        keeping those among the first ``keep_exact`` tokens unquantized too.
        ``transformed``: held decode tokens, already centered and weighted."""
        if not transformed:
            keys, values = self._weighted(*self._center(keys, values))
        if self.keep_exact and self._may_keep(offset):
            self._keep_exact_tokens(
                rotate(keys, self.key_codec.rotation),
                rotate(values, self.value_codec.rotation),
                offset,
            )
        return self.key_codec.encode(keys), self.value_codec.encode(values)

    def _may_keep(self, offset) -> bool:
        """Whether a write from ``offset`` on can hold kept tokens."""
        return offset < self._exact_rows()

    def _exact(self):
        """The kept tokens as attention takes them, or None."""
        count = self._exact_count()
        if not count:
            return None
        return self.exact_keys, self.exact_values, self._exact_first(), count

    def _check_dims(self, keys, values):
        self.key_codec.check_dim(keys.shape[-1])
        self.value_codec.check_dim(values.shape[-1])

    def _hold_first_write(self, keys, values, offset) -> bool:
        """With ``key_scale``, hold the first write of an empty cache until
        the first attention call (``_flush_first_write``); whether it was
        held."""
        if (
            not self.key_scale
            or self.key_weights is not None
            or self._pending is not None
            or not self.empty()
        ):
            return False
        self._check_dims(keys, values)
        valid = self._valid_range()
        self._center(keys, values)  # the means are those of this write
        self._pending = (keys, values, offset, valid)
        return True

    def _flush(self):
        """Encode what is held: the first write (key weights of ones if no
        attention call set them) and the held decode tokens."""
        self._flush_first_write()
        self._flush_held()

    def _flush_first_write(self, queries=None):
        """Set the key weights from ``queries`` (ones without) and encode
        the held first write."""
        if self._pending is None:
            return
        keys, values, offset, (start, stop) = self._pending
        self._pending = None
        self._set_key_weights(keys, queries, start, stop)
        self._write_pages(keys, values, offset, self.page_size)

    def _length(self) -> int:
        raise NotImplementedError

    def keys_and_values(self):
        """The encoded keys and values up to the length, as one tuple each (a
        copy when the cache has more than one page)."""
        self._flush()
        return tuple(
            tuple(x[..., : self._length(), :] for x in self._joined(pages))
            for pages in (self.key_pages, self.value_pages)
        )

    def dequantize(self, dtype=mx.float32):
        """The keys and values attention reads, decoded (the kept tokens as
        they came), rotated back and with the means of a centered cache
        added back."""
        keys, values = self.keys_and_values()
        keys = self.key_codec.decode(keys, dtype)
        values = self.value_codec.decode(values, dtype)
        exact = self._exact()
        if exact is not None:
            kept_keys, kept_values, first, count = exact
            keys = _with_exact(keys, kept_keys[..., :count, :], first)
            values = _with_exact(values, kept_values[..., :count, :], first)
        keys = rotate(keys, self.key_codec.rotation, inverse=True)
        values = rotate(values, self.value_codec.rotation, inverse=True)
        if self.key_weights is not None:
            keys = (keys / self.key_weights).astype(dtype)
        if self.key_mean is not None:
            keys = (keys + self.key_mean).astype(dtype)
        if self.value_mean is not None:
            values = (values + self.value_mean).astype(dtype)
        return keys, values

    def scaled_dot_product_attention(
        self, queries, keys, values, scale, mask, sinks=None
    ):
        self._flush_first_write(queries)
        sinks = self._center_sinks(queries, scale, sinks)
        codecs = (self.key_codec, self.value_codec)
        exact = self._exact()
        # CUDA kernels where they apply (codebook_kernel), else MLX ops; the
        # decode kernel weighs the queries and adds the value mean itself
        decode = queries.shape[2] == 1
        scaled = None if decode else self._scaled_queries(queries)
        held = None
        if self.n_held:
            held = (self.held_keys, self.held_values, self.n_held, self.incoming)
        length = self._length() - self.n_held
        result = codebook_kernel.attention(
            queries if decode else scaled,
            self.key_pages,
            self.value_pages,
            *codecs,
            scale,
            mask,
            sinks,
            length,
            held,
            exact,
            (self.key_mean, self.value_mean, self.key_weights),
        )
        if result is not None:
            out, buffers = result
            if buffers is not None:
                self.held_keys, self.held_values = buffers
                self.incoming = None
            return out if decode else self._uncenter(out)
        self._flush_held()
        out = codebook_scaled_dot_product_attention(
            self._scaled_queries(queries) if scaled is None else scaled,
            self.key_pages,
            self.value_pages,
            *codecs,
            scale=scale,
            mask=mask,
            sinks=sinks,
            length=self._length(),
            exact=exact,
        )
        return self._uncenter(out)

    def _set_state(
        self,
        keys,
        values,
        length: int,
        key_spec,
        value_spec,
        page_size,
        center="",
        key_mean=None,
        value_mean=None,
        keep_exact=0,
        exact_keys=None,
        exact_values=None,
        key_scale="",
        key_weights=None,
    ):
        """Set pages, codecs, means, kept tokens and key weights from a state after
        checking that the pages fit the codecs and hold ``length`` tokens and
        the means fit the pages (else a ValueError, and the cache is left as
        it was). States written before centering existed end at
        ``page_size``, before kept tokens at the value mean."""
        key_codec, value_codec = codec(key_spec), codec(value_spec)
        center = check_center_state(center, key_mean, value_mean)
        key_pages = self._pages_from_state(keys)
        value_pages = self._pages_from_state(values)
        for c, pages in ((key_codec, key_pages), (value_codec, value_pages)):
            if any(len(page) != c.parts for page in pages):
                raise ValueError(f"Cache state does not hold {c.spec} pages.")
        shapes = [
            (k[0].shape[:3], v[0].shape[:3]) for k, v in zip(key_pages, value_pages)
        ]
        if len(key_pages) != len(value_pages) or any(a != b for a, b in shapes):
            raise ValueError("Cache state has keys and values of different shapes.")
        if sum(page[0].shape[2] for page in key_pages) < length:
            raise ValueError("Cache state holds fewer tokens than its offset.")
        if key_mean is not None and (
            not key_pages or key_mean.shape[:2] != key_pages[0][0].shape[:2]
        ):
            raise ValueError("Cache state's means do not fit its pages.")
        if (exact_keys is None) != (exact_values is None):
            raise ValueError("Cache state has kept keys without values or back.")
        if key_weights is not None and (
            not key_pages or key_weights.shape[:2] != key_pages[0][0].shape[:2]
        ):
            raise ValueError("Cache state's key weights do not fit its pages.")
        self._set_codecs(
            key_codec,
            value_codec,
            page_size,
            key_scale=key_scale,
            key_weights=key_weights,
        )
        self._set_center_state(center, key_mean, value_mean)
        self._set_exact_state(keep_exact, exact_keys, exact_values)
        self.key_pages, self.value_pages = key_pages, value_pages

    def _tail_state(self):
        """What a state holds after the pages' settings: the centering, then
        the kept tokens and the key weights where set (older states end
        before them)."""
        tail = self._center_state()
        if self.keep_exact or self.key_scale:
            tail += (self.keep_exact, self.exact_keys, self.exact_values)
        if self.key_scale:
            tail += (self.key_scale, self.key_weights)
        return tail

    @property
    def nbytes(self):
        return (
            self._pages_nbytes
            + self._means_nbytes
            + self._exact_nbytes
            + self._weights_nbytes
            + self._held_nbytes
        )

    def empty(self):
        return not self.key_pages and self._pending is None

    def is_trimmable(self):
        return True


@register_cache_class
class CodebookKVCache(_CodebookKV, _BaseCache):
    """A KV cache of codebook-quantized keys and values, in pages.

    ``keys``/``values``: a ``Codebook``, ``Affine`` or ``Plain`` codec, an int
    (codebook bits, default rotation) or a codec spec; ``values`` defaults to
    the key codec. E.g. ``CodebookKVCache(3)`` or ``CodebookKVCache(3, 4)``.
    ``center="k"`` stores keys minus their per-head mean of the first write
    (exact: softmax ignores a shift common to a query's scores); ``"kv"``
    values too (the output gets their mean back). ``keep_exact=N`` keeps the
    first N tokens unquantized too, as ``QuantizedKVCache(keep_exact=N)``.
    ``key_scale="q"`` (or ``"qk"``) weighs the keys' channels by the
    queries (see ``query_key_weights``).
    """

    def __init__(
        self,
        keys=3,
        values=None,
        page_size=None,
        center="",
        keep_exact=0,
        key_scale="",
    ):
        self.key_pages = []
        self.value_pages = []
        self.offset = 0
        self._set_codecs(keys, values, page_size, center, keep_exact, key_scale)

    def _length(self):
        return self.offset

    def update_and_fetch(self, keys, values):
        # positions in the pages (a windowed cache drops its first ones)
        if not self._hold_first_write(keys, values, self._length()):
            if not self.empty() and keys.shape[2] == 1 and self._hold(keys, values):
                return self.key_pages, self.value_pages
            self._flush()
            if self.empty():
                self._check_dims(keys, values)
            self._write_pages(keys, values, self._length(), self.page_size)
        self.offset += keys.shape[2]
        return self.key_pages, self.value_pages

    def _buffer_size(self, keys, values) -> int:
        if self.decode_buffer is not None:
            return self.decode_buffer
        if self.held_keys is not None:
            # asked once per cache: a decode step's host time counts
            return self.held_keys.shape[2]
        codecs = (self.key_codec, self.value_codec)
        return 32 if codebook_kernel.holds(keys, values, *codecs) else 0

    def _hold(self, keys, values) -> bool:
        """Hold a decode token unquantized if the buffer is on (True)."""
        if self._pending is not None or self.offset < self._exact_rows():
            # the first tokens are kept as they are written to the pages
            return False
        size = self._buffer_size(keys, values)
        if not size:
            return False
        B, n_kv_heads, _, dim = keys.shape
        shape = (B, n_kv_heads, size, dim)
        if self.held_keys is None or self.held_keys.shape != shape:
            self._flush_held()
            self.held_keys = mx.zeros(shape, keys.dtype)
            self.held_values = mx.zeros((*shape[:3], values.shape[-1]), values.dtype)
        self._land_incoming()
        if self.n_held == size:
            # encoded as the next token comes, not as the last one lands:
            # every decode step attends a held token, so the kernel compiles
            # once (a variant with none took seconds at the first flush)
            self._flush_held()
        self.n_held += 1
        self.offset += 1
        if keys.dtype != self.held_keys.dtype:
            keys = keys.astype(self.held_keys.dtype)
        if values.dtype != self.held_values.dtype:
            values = values.astype(self.held_values.dtype)
        self.incoming = (keys, values)
        if not self.kernel_writes_held:
            self._land_incoming()
        return True

    def size(self):
        return self.offset

    def trim(self, n):
        self._flush()
        n = min(self.offset, n)
        self.offset -= n
        return n

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @property
    def state(self):
        self._flush()
        return (
            self._pages_state(self.key_pages),
            self._pages_state(self.value_pages),
            self.offset,
            self.key_codec.spec,
            self.value_codec.spec,
            self.page_size,
            *self._tail_state(),
        )

    @state.setter
    def state(self, v):
        keys, values, offset, *settings = v
        self._set_state(keys, values, offset, *settings)
        self.offset = int(offset)
        self.n_held = 0
        self.incoming = None

    @classmethod
    def merge(cls, caches):
        return BatchCodebookKVCache.merge(caches)


@register_cache_class
class WindowedCodebookKVCache(CodebookKVCache):
    """``CodebookKVCache`` for a sliding-window layer (Gemma 3's local ones):
    the pages whose tokens no query can see any more, all older than the
    ``window`` tokens before the call's first query, are dropped, so the
    layer holds at most ``max_size`` tokens between decode steps where a
    ``CodebookKVCache`` holds the whole context. The masks the model makes
    (``make_mask(window_size=...)``) lose the dropped tokens' columns;
    attention is the same. Pages default to the window's size (in multiples
    of 16, as the decode kernel's tiles). The first tokens kept unquantized
    (``keep_exact``) go with the first page. Not batched (``merge``), and
    trimmable only until a page is dropped."""

    def __init__(self, window: int, keys=3, values=None, page_size=None, **kwargs):
        if window < 1:
            raise ValueError(f"A window must hold at least one token, got {window}.")
        page_size = page_size or -(-window // 16) * 16
        super().__init__(keys, values, page_size, **kwargs)
        self.window = int(window)
        self.dropped = 0

    # one page per window: generate_step's reservation (one page for the
    # whole generation) would hold every token
    @property
    def reserve(self):
        return None

    @reserve.setter
    def reserve(self, tokens):
        pass

    @property
    def max_size(self):
        """The most tokens its pages hold between decode steps: a window's
        worth and the rest of the page the oldest token it sees is in."""
        return -(-(self.window + self.page_size - 1) // self.page_size) * self.page_size

    def _length(self):
        return self.offset - self.dropped

    def _dropped_at(self, offset: int) -> int:
        """Tokens dropped once a call's queries start at ``offset``: the
        whole pages before the first token its first query sees."""
        unseen = offset - self.window + 1 - self.dropped
        return self.dropped + max(0, unseen // self.page_size) * self.page_size

    def _drop_unseen(self):
        pages = (self._dropped_at(self.offset) - self.dropped) // self.page_size
        if not pages:
            return
        del self.key_pages[:pages], self.value_pages[:pages]
        self.dropped += pages * self.page_size
        # the kept first tokens were in the first page
        self.exact_keys = self.exact_values = None

    def update_and_fetch(self, keys, values):
        self._drop_unseen()
        return super().update_and_fetch(keys, values)

    def _may_keep(self, offset) -> bool:
        return not self.dropped and super()._may_keep(offset)

    def make_mask(self, N, return_array=False, window_size=None):
        mask = create_attention_mask(N, self.offset, return_array, window_size)
        dropped = self._dropped_at(self.offset)
        if dropped and isinstance(mask, mx.array):
            mask = mask[..., dropped:]
        return mask

    def is_trimmable(self):
        return not self.dropped

    def trim(self, n):
        return super().trim(min(n, self._length()))

    @property
    def state(self):
        return (self.window, self.dropped, *super().state)

    @state.setter
    def state(self, v):
        window, dropped, keys, values, offset, *settings = v
        self._set_state(keys, values, int(offset) - int(dropped), *settings)
        self.window, self.dropped, self.offset = int(window), int(dropped), int(offset)
        self.n_held = 0
        self.incoming = None

    @classmethod
    def merge(cls, caches):
        raise NotImplementedError(
            "WindowedCodebookKVCache does not batch: its sequences drop "
            "different pages."
        )


@register_cache_class
class BatchCodebookKVCache(_BatchExactKV, _CodebookKV, BatchKVCache):
    """``CodebookKVCache`` for a batch of left-padded sequences, as mlx-lm's
    ``BatchQuantizedKVCache``: ``merge`` (of ``CodebookKVCache``), ``filter``,
    ``extend``, ``extract``, ``prepare`` and ``finalize`` move packed indices
    and norms, never decoding them. Kept tokens (``keep_exact``) are laid
    out as ``BatchQuantizedKVCache`` lays them out: token ``j`` of sequence
    ``i`` at position ``left_padding[i] + j``."""

    def __init__(
        self,
        left_padding,
        keys=3,
        values=None,
        page_size=None,
        center="",
        keep_exact=0,
        key_scale="",
    ):
        super().__init__(left_padding)
        self.key_pages = []
        self.value_pages = []
        self._set_codecs(keys, values, page_size, center, keep_exact, key_scale)

    def _may_keep(self, offset) -> bool:
        return self._exact_stop is None or offset < self._exact_stop

    def _length(self):
        return self._idx

    def _set_pages(self, keys, values):
        self.key_pages, self.value_pages = [keys], [values]

    def update_and_fetch(self, keys, values):
        if not self._hold_first_write(keys, values, self._idx):
            self._flush()
            if self.empty():
                self._check_dims(keys, values)
            self._write_pages(keys, values, self._idx, self.page_size)
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        return self.key_pages, self.value_pages

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None and not self.empty():
            raise ValueError("Left padding can only be added to an empty cache.")
        super().prepare(
            left_padding=left_padding, lengths=lengths, right_padding=right_padding
        )
        if lengths is not None and self.key_mean is None:
            # right padding is left out of the means of a first write
            self._valid_stop = mx.array(lengths) + self._idx
        self._exact_stop = None

    def finalize(self):
        """Move right-padded prompts to the right end (once, after prefill)."""
        if self._right_padding is None:
            return
        self._flush()
        shift = self._right_padding[:, None]
        rolled = (
            tuple(dynamic_roll(x, shift, axis=2) for x in self._joined(pages))
            for pages in (self.key_pages, self.value_pages)
        )
        self._set_pages(*rolled)
        self.offset = self.offset - self._right_padding
        self.left_padding = self.left_padding + self._right_padding
        self._right_padding = None
        self._exact_stop = None

    @property
    def state(self):
        self._flush()
        return (
            self._pages_state(self.key_pages),
            self._pages_state(self.value_pages),
            self.offset,
            self.left_padding,
            self._idx,
            self.key_codec.spec,
            self.value_codec.spec,
            self.page_size,
            *self._tail_state(),
        )

    @state.setter
    def state(self, v):
        keys, values, offset, left_padding, idx, *settings = v
        self._set_state(keys, values, idx, *settings)
        self.offset, self.left_padding, self._idx = offset, left_padding, int(idx)
        self._right_padding = None
        self._exact_stop = None

    def filter(self, batch_indices):
        """Keep the sequences ``batch_indices``, dropping left padding that all
        of them share (whole pages of it, and a view into the first page)."""
        self._flush()
        for pages in (self.key_pages, self.value_pages):
            pages[:] = [tuple(x[batch_indices] for x in page) for page in pages]
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        self._filter_means(batch_indices)
        self._filter_exact(batch_indices)
        if self.key_weights is not None:
            self.key_weights = self.key_weights[batch_indices]
        shared = min(self.left_padding.tolist())
        if shared <= 0:
            return
        for pages in (self.key_pages, self.value_pages):
            skip = shared
            while pages and pages[0][0].shape[2] <= skip:
                skip -= pages.pop(0)[0].shape[2]
            if skip:
                pages[0] = tuple(x[:, :, skip:] for x in pages[0])
        self._idx -= shared
        self.left_padding = self.left_padding - shared

    def _padded(self, idx: int, size: int, like):
        """Key and value tuples of ``size`` rows with this cache's tokens ending
        at row ``idx`` (zeros shaped like ``like`` when the cache is empty)."""
        if self.empty():
            B = self.offset.shape[0]
            return tuple(
                tuple(mx.zeros((B, x.shape[1], size, x.shape[3]), x.dtype) for x in t)
                for t in like
            )
        left = idx - self._idx

        def justify(x):
            x = x[:, :, : size - left]
            return mx.pad(x, [(0, 0), (0, 0), (left, size - left - x.shape[2]), (0, 0)])

        return tuple(
            tuple(map(justify, self._joined(pages)))
            for pages in (self.key_pages, self.value_pages)
        )

    def extend(self, other):
        """Append the sequences of ``other`` (a cache of the same codecs)."""
        if self._settings() != other._settings():
            raise ValueError(
                "Cannot batch codebook caches with different settings: "
                f"{self._settings()} and {other._settings()}"
            )
        self._flush()
        other._flush()
        sizes = [c.offset.shape[0] for c in (self, other)]
        means = self._joined_means([self._means(), other._means()], sizes)
        self.key_mean, self.value_mean = means
        weights = [self.key_weights, other.key_weights]
        self.key_weights = self._joined_weights(weights, sizes)
        self.exact_keys, self.exact_values = self._joined_exact(
            [
                (c.exact_keys, c.exact_values, c.offset.shape[0], c._exact_needed())
                for c in (self, other)
            ],
            self.keep_exact,
        )
        self._exact_stop = None
        if self.empty() and other.empty():
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        size = max(self.capacity, other.capacity)
        like = (other if self.empty() else self).keys_and_values()
        (k1, v1), (k2, v2) = (c._padded(idx, size, like) for c in (self, other))
        self._set_pages(
            tuple(mx.concatenate(x, axis=0) for x in zip(k1, k2)),
            tuple(mx.concatenate(x, axis=0) for x in zip(v1, v2)),
        )
        self.left_padding = mx.concatenate(
            [c.left_padding + idx - c._idx for c in (self, other)]
        )
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = idx

    def extract(self, idx):
        """Sequence ``idx`` as a ``CodebookKVCache`` (a copy, padding dropped)."""
        cache = CodebookKVCache(**self._settings(), page_size=self.page_size)
        padding = self.left_padding.tolist()[idx]
        keys, values = self.keys_and_values()
        cache.key_pages, cache.value_pages = (
            [tuple(mx.contiguous(x[idx : idx + 1, :, padding:]) for x in stored)]
            for stored in (keys, values)
        )
        cache.offset = self._idx - padding
        self._extract_exact(idx, cache, cache.offset)
        if self.key_weights is not None:
            cache.key_weights = self.key_weights[idx : idx + 1]
        return self._extract_means(idx, cache)

    @classmethod
    def merge(cls, caches):
        """One batch of ``CodebookKVCache``s, left-padded to the longest."""
        for c in caches:
            c._flush()
        settings = [c._settings() for c in caches]
        if any(s != settings[0] for s in settings):
            raise ValueError(
                f"Cannot batch codebook caches with different settings: {settings}"
            )
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        batch = cls(padding, **settings[0], page_size=caches[0].page_size)
        means = cls._joined_means([c._means() for c in caches], [1] * len(caches))
        batch.key_mean, batch.value_mean = means
        weights = [c.key_weights for c in caches]
        batch.key_weights = cls._joined_weights(weights, [1] * len(caches))
        if batch.keep_exact:
            batch.exact_keys, batch.exact_values = cls._joined_exact(
                [
                    (c.exact_keys, c.exact_values, 1, min(c.keep_exact, c.offset))
                    for c in caches
                ],
                batch.keep_exact,
            )
        if longest == 0:
            return batch
        stored = [c.keys_and_values() if c.offset else None for c in caches]
        like = next(s for s in stored if s is not None)
        merged = tuple(
            tuple(
                mx.zeros((len(caches), x.shape[1], longest, x.shape[3]), x.dtype)
                for x in part
            )
            for part in like
        )
        for i, (p, s) in enumerate(zip(padding, stored)):
            for rows, part in zip(merged, s or ()):
                for dst, x in zip(rows, part):
                    dst[i : i + 1, :, p:] = x
        batch._set_pages(*merged)
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    def size(self):
        return self._idx


# last: codebook_kernel imports this module's codecs
from . import codebook_kernel
