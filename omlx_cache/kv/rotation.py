"""Orthogonal rotations of the last axis, applied before quantization.

A rotation spreads outlier channels over all channels, so a quantizer's range
is not spent on a few of them. Scores are unchanged when queries are rotated
the same way, and an output computed from rotated values is rotated back.
"""

from functools import lru_cache

import mlx.core as mx
import numpy as np

ROTATIONS = ("hadamard", "givens", "none")

_MATRICES = {}
# the m of the sizes m * 2**k that mx.hadamard_transform takes
HADAMARD_BASES = (1, 12, 20, 28)


def has_hadamard(dim: int) -> bool:
    """Whether ``mx.hadamard_transform`` takes ``dim`` (``m * 2**k``, m in
    ``HADAMARD_BASES``). Other sizes must not reach it: MLX 0.32 raises for
    some (88, 104) and corrupts the heap for others (72, 120, 144)."""
    while dim % 2 == 0 and dim not in HADAMARD_BASES:
        dim //= 2
    return dim in HADAMARD_BASES


def hadamard_matrix(dim: int, dtype=mx.float32) -> mx.array:
    """An orthogonal ``dim x dim`` matrix: the normalised Hadamard transform
    where ``mx.hadamard_transform`` has it (``dim = m * 2**k``, m in 1, 12,
    20, 28), else a fixed random orthogonal matrix (seed 0)."""
    if (dim, dtype) not in _MATRICES:
        eye = mx.eye(dim)
        orthogonal = False
        if has_hadamard(dim):
            rotation = mx.hadamard_transform(eye, stream=mx.cpu)
            # checked on the CPU: a GPU matmul may run in TF32, too coarse for 1e-4
            product = mx.matmul(rotation, rotation.T, stream=mx.cpu)
            orthogonal = mx.allclose(product, eye, atol=1e-4, stream=mx.cpu).item()
        if not orthogonal:
            normal = mx.random.normal((dim, dim), key=mx.random.key(0))
            rotation, _ = mx.linalg.qr(normal, stream=mx.cpu)
        _MATRICES[dim, dtype] = rotation.astype(dtype)
    return _MATRICES[dim, dtype]


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


def _fast_hadamard(dim: int, inverse: bool) -> bool:
    """Whether ``mx.hadamard_transform`` is the rotation (or its inverse, where
    the matrix is symmetric: ``dim`` a power of two): on the GPU, where one
    such kernel costs a third of a small matmul's launch (the CPU's is the
    slower)."""
    if mx.default_device() != mx.gpu or not has_hadamard(dim):
        return False
    return not inverse or dim & (dim - 1) == 0


def rotate(x: mx.array, rotation: str, inverse: bool = False) -> mx.array:
    """Apply the named rotation to the last axis of ``x`` (or undo it)."""
    if rotation == "hadamard":
        if _fast_hadamard(x.shape[-1], inverse):
            return mx.hadamard_transform(x, scale=x.shape[-1] ** -0.5)
        matrix = hadamard_matrix(x.shape[-1], x.dtype)
        return x @ (matrix.T if inverse else matrix)
    if rotation == "givens":
        return givens_rotate(x, inverse=inverse)
    return x


def check_rotation(rotation: str) -> str:
    if rotation not in ROTATIONS:
        raise ValueError(f"Unknown rotation {rotation!r}; one of {ROTATIONS}.")
    return rotation
