"""How one tensor (keys or values) is stored: a codec.

A codec turns vectors (the last axis) into a page's arrays and back:
``encode``, ``decode``, ``empty_page``, and for attention over a tile of a
page ``scores`` (queries @ keys.T) and ``weigh`` (probabilities @ values),
which may skip decoding. ``rotation`` is applied before encoding; attention
rotates the queries by the key codec's and the output back by the value
codec's. ``bits_per_element(dim)`` is what an element costs, scales and
norms included.

- ``Affine``: mlx's affine quantization (``mx.quantize``), ``bits`` and
  ``group_size``, optionally rotated; a group's offset a float16 bias or an
  integer zero point packed with its scale in one 16-bit word.
- ``Codebook``: a Lloyd-Max codebook on rotated unit vectors (``codebook``).
- ``Plain``: unquantized, in the model's dtype.
"""

import functools
import re
from dataclasses import dataclass, replace

import mlx.core as mx

from .codebook import NORM_BITS, Codebook, _zeros
from .rotation import check_rotation, rotate

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)
# a group's offset: mlx's float16 bias beside its float16 scale ("float"), or
# an integer zero point in one 16-bit word with the scale ("int")
OFFSETS = ("float", "int")
# the bits "int" offsets take (codes that fill whole uint32 words)
INT_OFFSET_BITS = (2, 4, 8)
# the scales and biases of affine quantization, as a 16-bit model stores them
SCALE_BITS = 16
# Query rows from which the CPU multiplies by a dequantized tile: MLX's CPU
# quantized_matmul is 5-40x slower than a BLAS float32 matmul from 24 rows
# (prefill) and as fast for decode's few rows.
CPU_DEQUANTIZED_ROWS = 16


def _on_cuda() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def _multiplies_dequantized(rows: int) -> bool:
    """Whether a tile of ``rows`` queries or probabilities is multiplied by the
    dequantized tile rather than by ``mx.quantized_matmul``: on CUDA always
    (MLX 0.32.4's quantized_matmul is wrong when a row is a single group and
    fails on some float32 shapes), on the CPU from ``CPU_DEQUANTIZED_ROWS``."""
    if _on_cuda():
        return True
    return mx.default_device() == mx.cpu and rows >= CPU_DEQUANTIZED_ROWS


@dataclass(frozen=True)
class Affine:
    """mlx's affine quantization (``mx.quantize``), after an optional rotation.

    ``offset="int"`` stores a group's offset as an integer zero point ``z``
    (the group decodes to ``scale * (code - z)``): one 16-bit word a group,
    the float16 scale whose lowest ``bits`` mantissa bits hold ``z``. That
    is 16 bits a group where the float offset takes 32, so groups of 32
    cost what mlx's groups of 64 do, with a fifth less error at 4 bits.
    With those bits zero, ``scale * (code - z)`` is exact in float16: a page
    decodes as mlx's would with the scales and biases ``-scale * z``.
    """

    bits: int = 4
    group_size: int = 64
    rotation: str = "none"
    offset: str = "float"

    def __post_init__(self):
        if self.bits not in AFFINE_BITS:
            raise ValueError(
                f"KV cache bits must be one of {AFFINE_BITS}, got {self.bits}."
            )
        if self.group_size not in AFFINE_GROUP_SIZES:
            raise ValueError(
                f"KV cache group size must be one of {AFFINE_GROUP_SIZES}, "
                f"got {self.group_size}."
            )
        check_rotation(self.rotation)
        if self.offset not in OFFSETS:
            raise ValueError(
                f"Affine offset must be one of {OFFSETS}, got {self.offset!r}."
            )
        if self.offset == "int" and self.bits not in INT_OFFSET_BITS:
            raise ValueError(
                "offset=int takes bits 2, 4 or 8 (codes in whole uint32 words), "
                f"got {self.bits}."
            )

    @property
    def parts(self) -> int:
        """Arrays per page: packed, scales, biases (packed, words)."""
        return 3 if self.offset == "float" else 2

    @property
    def spec(self) -> str:
        spec = f"affine-{self.bits}-{self.group_size}-{self.rotation}"
        return spec if self.offset == "float" else f"{spec}-int"

    def bits_per_element(self, dim: int) -> float:
        words = 2 if self.offset == "float" else 1
        return self.bits + words * SCALE_BITS / self.group_size

    def check_dim(self, dim: int):
        if dim % self.group_size:
            raise ValueError(
                f"Head dim {dim} is not a multiple of the group size {self.group_size}."
            )

    def dim(self, page) -> int:
        return page[0].shape[-1] * 32 // self.bits

    def empty_page(self, x: mx.array, size: int):
        dim, groups = x.shape[-1] * self.bits // 32, x.shape[-1] // self.group_size
        if self.offset == "int":
            return _zeros(x, size, (dim, mx.uint32), (groups, mx.uint16))
        return _zeros(x, size, (dim, mx.uint32), (groups, x.dtype), (groups, x.dtype))

    def encode(self, x: mx.array, rotated: bool = False):
        if not rotated:
            x = rotate(x, self.rotation)
        if self.offset == "int":
            return _encode_int(x, self.bits, self.group_size)
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def quantized(self, page, dtype):
        """``page`` as ``mx.quantize`` makes it: (packed, scales, biases),
        the scales and biases in ``dtype``."""
        if self.offset == "float":
            packed, scales, biases = page
            return packed, scales.astype(dtype), biases.astype(dtype)
        packed, words = page
        return (packed, *scales_biases(words, self.bits, dtype))

    def decode(self, page, dtype) -> mx.array:
        # float32 scales and biases: the dequantized tile exactly
        x = mx.dequantize(*self.quantized(page, mx.float32), self.group_size, self.bits)
        return x.astype(dtype)

    def _tile(self, tile, dtype):
        return tile if self.offset == "float" else self.quantized(tile, dtype)

    def scores(self, queries: mx.array, tile) -> mx.array:
        if _multiplies_dequantized(queries.shape[-2]):
            return queries @ self.decode(tile, queries.dtype).swapaxes(-1, -2)
        return mx.quantized_matmul(
            queries,
            *self._tile(tile, queries.dtype),
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
        )

    def weigh(self, probs: mx.array, tile) -> mx.array:
        if _multiplies_dequantized(probs.shape[-2]):
            return probs @ self.decode(tile, probs.dtype)
        return mx.quantized_matmul(
            probs,
            *self._tile(tile, probs.dtype),
            transpose=False,
            group_size=self.group_size,
            bits=self.bits,
        )


def _encode_int(x: mx.array, bits: int, group_size: int):
    """(packed codes, 16-bit words) of ``x`` in groups of ``group_size``: the
    range of each group and 0 split into 2**bits - 1 steps of the scale
    rounded up to what a word keeps, the zero point the nearest code to 0."""
    top = (1 << bits) - 1
    groups = x.astype(mx.float32).reshape(*x.shape[:-1], -1, group_size)
    low = mx.minimum(groups.min(axis=-1, keepdims=True), 0)
    high = mx.maximum(groups.max(axis=-1, keepdims=True), 0)
    # at least float16's smallest step, at most its largest finite number
    scale = mx.clip((high - low) / top, 2.0**-24, 65504.0)
    half = mx.view(scale.astype(mx.float16), mx.uint16).astype(mx.uint32)
    # rounded up: the positive float16s' bits order as their values
    kept = mx.minimum((half + top) & (0xFFFF ^ top), 0x7BFF & (0xFFFF ^ top))
    scale = scales_biases(kept, bits, mx.float32)[0]
    zero = mx.clip(mx.round(-low / scale), 0, top)
    codes = mx.clip(mx.round(groups / scale) + zero, 0, top).astype(mx.uint32)
    codes = codes.reshape(*x.shape[:-1], -1, 32 // bits)
    shifts = bits * mx.arange(32 // bits, dtype=mx.uint32)
    packed = (codes << shifts).sum(axis=-1).astype(mx.uint32)
    words = kept | zero.astype(mx.uint32)
    return packed, words.squeeze(-1).astype(mx.uint16)


def scales_biases(words: mx.array, bits: int, dtype):
    """The scales and biases (``dtype``) of 16-bit offset words."""
    return _scales_biases(bits, dtype)(words)


@functools.cache
def _scales_biases(bits: int, dtype):
    """``scales_biases`` compiled into one kernel for any shape: the half
    scale decoded from its exponent and mantissa bits by arithmetic (a
    compiled graph cannot view its bits as a half for every shape)."""
    top = (1 << bits) - 1

    def decode(words):
        words = words.astype(mx.uint32)
        mantissa = (words & (0x3FF ^ top)).astype(mx.float32)
        exponent = ((words >> 10) & 31).astype(mx.float32)
        normal = (1024 + mantissa) * mx.power(2.0, exponent - 25)
        scale = mx.where(exponent > 0, normal, mantissa * 2.0**-24)
        zero = (words & top).astype(mx.float32)
        return scale.astype(dtype), (-zero * scale).astype(dtype)

    return mx.compile(decode, shapeless=True)


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

    def encode(self, x: mx.array, rotated: bool = False):
        return (x,)

    def decode(self, page, dtype) -> mx.array:
        return page[0].astype(dtype)

    def scores(self, queries: mx.array, tile) -> mx.array:
        return queries @ self.decode(tile, queries.dtype).swapaxes(-1, -2)

    def weigh(self, probs: mx.array, tile) -> mx.array:
        return probs @ self.decode(tile, probs.dtype)


Codec = Affine | Codebook | Plain


def for_dim(c: Codec, dim: int) -> Codec:
    """``c``, or what stores a head dim ``dim`` that ``c`` cannot: affine with
    the largest group size up to its own that divides ``dim``, else
    unquantized (``Plain``)."""
    try:
        c.check_dim(dim)
        return c
    except ValueError:
        pass
    if isinstance(c, Affine):
        for group in sorted(AFFINE_GROUP_SIZES, reverse=True):
            if group < c.group_size and dim % group == 0:
                return replace(c, group_size=group)
    return Plain()


def why_not(c: Codec, dim: int) -> str:
    """Why ``c`` cannot store head dim ``dim`` ("" if it can)."""
    try:
        c.check_dim(dim)
        return ""
    except ValueError as e:
        return str(e)


def codec(spec) -> Codec:
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
    match = re.fullmatch(r"affine-(\d+)-(\d+)-([a-z]+)(-int)?", spec)
    if match:
        offset = "int" if match[4] else "float"
        return Affine(int(match[1]), int(match[2]), match[3], offset)
    raise ValueError(f"Unknown KV codec {spec!r}.")
