"""A b-bit codebook codec (TurboQuant / PlanarQuant style).

Each key or value vector (one head, length D) is stored as a norm in float16
and, for each of its D coordinates after an orthogonal rotation, a b-bit
index into a Lloyd-Max codebook. A rotated unit vector's coordinates are
close to N(0, 1/D) whatever the input, so one fixed codebook (the Lloyd-Max
levels of a unit Gaussian, scaled by 1/sqrt(D)) fits every head and layer
without calibration. Indices are packed densely (32 three-bit indices in 3
uint32 words, as sign and magnitude for the CUDA kernels), so an element
costs b + 16/D bits: 3.125 at D = 128.
"""

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import mlx.core as mx
import numpy as np

from . import kernels
from .rotation import check_rotation, rotate

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
        check_rotation(self.rotation)
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

    def encode(self, x: mx.array, rotated: bool = False):
        """(packed indices, float16 norms) of the vectors on the last axis
        (``rotated``: already in the rotated domain)."""
        if rotated and self.rotation != "none":
            return replace(self, rotation="none").encode(x)
        encoded = kernels.encode(x, self)
        if encoded is not None:
            return encoded
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

    def scores(self, queries: mx.array, tile) -> mx.array:
        """``queries @ keys.T`` over a tile of the page, in the queries' dtype."""
        return queries @ self.decode(tile, queries.dtype).swapaxes(-1, -2)

    def weigh(self, probs: mx.array, tile) -> mx.array:
        """``probs @ values`` over a tile of the page, in the probabilities' dtype."""
        return probs @ self.decode(tile, probs.dtype)


def encode_norm(norm: mx.array) -> mx.array:
    """Float norms as 8-bit codes: log2 in steps of ``NORM8_STEP`` octaves
    from ``2**NORM8_LOW``, rounded to the nearest (clipped to 0..255)."""
    log = mx.log2(mx.maximum(norm.astype(mx.float32), 1e-30))
    code = mx.round((log - NORM8_LOW) / NORM8_STEP)
    return mx.clip(code, 0, 255).astype(mx.uint8)


def decode_norm(code: mx.array) -> mx.array:
    """The float32 norms of 8-bit codes (``encode_norm``)."""
    return mx.power(2.0, code.astype(mx.float32) * NORM8_STEP + NORM8_LOW)
