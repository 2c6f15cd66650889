"""How one tensor (keys or values) is stored: a codec.

A codec turns vectors (the last axis) into a page's arrays and back:
``encode``, ``decode``, ``empty_page``, and for attention over a tile of a
page ``scores`` (queries @ keys.T) and ``weigh`` (probabilities @ values),
which may skip decoding. ``rotation`` is applied before encoding; attention
rotates the queries by the key codec's and the output back by the value
codec's. ``bits_per_element(dim)`` is what an element costs, scales and
norms included.

- ``Affine``: mlx's affine quantization (``mx.quantize``), ``bits`` and
  ``group_size``, optionally rotated.
- ``Codebook``: a Lloyd-Max codebook on rotated unit vectors (``codebook``).
- ``Plain``: unquantized, in the model's dtype.
"""

import re
from dataclasses import dataclass, replace

import mlx.core as mx

from .codebook import NORM_BITS, Codebook, _zeros
from .rotation import check_rotation, rotate

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)
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
    """mlx's affine quantization (``mx.quantize``), after an optional rotation."""

    bits: int = 4
    group_size: int = 64
    rotation: str = "none"
    parts = 3  # arrays per page: packed, scales, biases

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

    @property
    def spec(self) -> str:
        return f"affine-{self.bits}-{self.group_size}-{self.rotation}"

    def bits_per_element(self, dim: int) -> float:
        return self.bits + 2 * SCALE_BITS / self.group_size

    def check_dim(self, dim: int):
        if dim % self.group_size:
            raise ValueError(
                f"Head dim {dim} is not a multiple of the group size {self.group_size}."
            )

    def dim(self, page) -> int:
        return page[0].shape[-1] * 32 // self.bits

    def empty_page(self, x: mx.array, size: int):
        dim, groups = x.shape[-1] * self.bits // 32, x.shape[-1] // self.group_size
        return _zeros(x, size, (dim, mx.uint32), (groups, x.dtype), (groups, x.dtype))

    def encode(self, x: mx.array, rotated: bool = False):
        if not rotated:
            x = rotate(x, self.rotation)
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def decode(self, page, dtype) -> mx.array:
        packed, scales, biases = page
        # float32 scales and biases: the dequantized tile exactly
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        x = mx.dequantize(packed, scales, biases, self.group_size, self.bits)
        return x.astype(dtype)

    def scores(self, queries: mx.array, tile) -> mx.array:
        if _multiplies_dequantized(queries.shape[-2]):
            return queries @ self.decode(tile, queries.dtype).swapaxes(-1, -2)
        return mx.quantized_matmul(
            queries, *tile, transpose=True, group_size=self.group_size, bits=self.bits
        )

    def weigh(self, probs: mx.array, tile) -> mx.array:
        if _multiplies_dequantized(probs.shape[-2]):
            return probs @ self.decode(tile, probs.dtype)
        return mx.quantized_matmul(
            probs, *tile, transpose=False, group_size=self.group_size, bits=self.bits
        )


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
    match = re.fullmatch(r"affine-(\d+)-(\d+)-(\w+)", spec)
    if match:
        return Affine(int(match[1]), int(match[2]), match[3])
    raise ValueError(f"Unknown KV codec {spec!r}.")
