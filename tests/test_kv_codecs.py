"""The codecs of ``omlx_cache.kv``: the Lloyd-Max codebook, bit packing,
rotations, encode and decode, the bits an element costs, codec specs and the
settings each codec refuses."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from kv_helpers import codec_round, relative_error

from omlx_cache.kv import Affine, Codebook, Plain, codec
from omlx_cache.kv.codebook import (
    decode_norm,
    encode_norm,
    gaussian_mse,
    lloyd_max,
    pack,
    packed_dim,
    sign_magnitude_3bit,
    split_5bit,
    unpack,
)
from omlx_cache.kv.codecs import CPU_DEQUANTIZED_ROWS, for_dim, scales_biases
from omlx_cache.kv.rotation import givens_rotate, hadamard_matrix, has_hadamard, rotate

# ---------------------------------------------------------------------------
# The Lloyd-Max codebook of a unit Gaussian


def test_lloyd_max_mse_of_a_unit_gaussian():
    levels, mse = lloyd_max(3)
    # 0.03455 and 0.009501 in Max (1960)
    assert mse == pytest.approx(0.03455, abs=1e-5)
    assert lloyd_max(4)[1] == pytest.approx(0.009501, abs=1e-6)
    assert np.allclose(levels, -np.array(levels[::-1]))
    # a sample agrees with the exact integral
    x = np.random.default_rng(0).standard_normal(400_000)
    levels = np.array(levels)
    nearest = levels[np.abs(x[:, None] - levels).argmin(axis=1)]
    assert abs(np.mean((x - nearest) ** 2) - mse) < 1e-3


@pytest.mark.parametrize("bits", range(1, 7))
def test_lloyd_max_levels_are_their_cells_means(bits):
    levels, mse = lloyd_max(bits)
    assert len(levels) == 1 << bits and list(levels) == sorted(levels)
    assert mse == pytest.approx(gaussian_mse(np.array(levels)))
    # one bit: the two levels are +-E|x| = sqrt(2 / pi)
    if bits == 1:
        assert levels[1] == pytest.approx(np.sqrt(2 / np.pi))
    # each more bit cuts the error, about fourfold
    if bits > 1:
        assert 3 < lloyd_max(bits - 1)[1] / mse < 4.5


# ---------------------------------------------------------------------------
# Packing


@pytest.mark.parametrize("bits,dim", itertools.product(range(1, 7), [64, 128, 256]))
def test_pack_round_trip_without_wasted_bits(bits, dim):
    mx.random.seed(bits * dim)
    indices = mx.random.randint(0, 1 << bits, (2, 3, 5, dim)).astype(mx.uint32)
    packed = pack(indices, bits)
    assert packed.dtype == mx.uint32
    assert (
        packed.shape == (2, 3, 5, dim * bits // 32) == (2, 3, 5, packed_dim(dim, bits))
    )
    assert mx.array_equal(unpack(packed, bits), indices)
    # every bit is used: all-ones indices pack into all-ones words
    ones = pack(mx.full((dim,), (1 << bits) - 1, mx.uint32), bits)
    assert (ones == 0xFFFFFFFF).all().item()


@pytest.mark.parametrize("bits,dim", [(3, 48), (5, 16), (4, 4), (6, 8)])
def test_pack_needs_whole_blocks(bits, dim):
    with pytest.raises(ValueError, match="packing needs a multiple"):
        packed_dim(dim, bits)


def test_three_bit_layout_is_sign_and_magnitude():
    # element 0: magnitude in word 0 bits 0-1, sign in word 2 bit 0; element
    # 4 (same pair): magnitude bits 8-9, sign bit 16; element 16: word 1
    layout = sign_magnitude_3bit()
    assert [int(a[0]) for a in layout] == [0, 0, 0]
    assert [int(a[4]) for a in layout] == [0, 8, 16]
    assert [int(a[16]) for a in layout] == [1, 0, 8]
    indices = np.zeros((32,), np.uint32)
    indices[4] = 4  # the smallest positive level: magnitude 0, sign 1
    indices[16] = 0  # the most negative: magnitude 3, sign 0
    words = np.array(pack(mx.array(indices), 3))
    assert words[2] == (1 << 16)
    assert words[1] & 3 == 3
    assert (np.array(unpack(mx.array(words), 3)) == indices).all()


def test_five_bit_layout_splits_off_the_high_bits():
    # the low four bits as 4-bit packing; high bits of elements 0 and 4 at
    # bits 0 and 16 of word 4, of element 9 (word 1, nibble 1) at bit 5
    assert list(split_5bit()[[0, 4, 9, 31]]) == [0, 16, 5, 31]
    indices = np.arange(32, dtype=np.uint32)
    words = np.array(pack(mx.array(indices), 5))
    assert (words[:4] == np.array(pack(mx.array(indices & 15), 4))).all()
    assert words[4] == sum(1 << int(s) for s in split_5bit()[16:])
    assert (np.array(unpack(mx.array(words), 5)) == indices).all()


# ---------------------------------------------------------------------------
# Rotations


@pytest.mark.parametrize("rotation", ["hadamard", "givens", "none"])
@pytest.mark.parametrize("dim", [64, 96, 72, 88])
def test_rotations_are_orthogonal(rotation, dim):
    x = mx.random.normal((3, dim), key=mx.random.key(dim))
    y = rotate(x, rotation)
    assert mx.allclose(mx.linalg.norm(y, axis=-1), mx.linalg.norm(x, axis=-1))
    assert mx.allclose(rotate(y, rotation, inverse=True), x, atol=1e-5)
    if rotation == "givens":
        # planes of two coordinates: the other coordinates stay put
        e = mx.zeros((1, 8)).at[0, 2].add(1.0)
        assert (givens_rotate(e)[0, 4:] == 0).all().item()
    if rotation == "hadamard":
        # a Hadamard matrix where mx.hadamard_transform has one (64, 96 = 12 *
        # 2**3), else a random orthogonal one: MLX raises for 88 and aborts
        # the process for 72, so those must not reach it
        matrix = hadamard_matrix(dim)
        assert mx.allclose(matrix @ matrix.T, mx.eye(dim), atol=1e-4)
        entries = (matrix.abs() - dim**-0.5).abs().max().item() < 1e-6
        assert has_hadamard(dim) == entries == (dim in (64, 96))


def test_an_unknown_rotation_is_refused():
    with pytest.raises(ValueError, match="Unknown rotation 'twirl'"):
        Affine(4, 64, "twirl")
    with pytest.raises(ValueError, match="Unknown rotation 'twirl'"):
        Codebook(3, "twirl")


# ---------------------------------------------------------------------------
# Codebook encode and decode


@pytest.mark.parametrize("bits,norm", itertools.product([3, 4], ["dot", "length"]))
def test_reconstruction_error_near_lloyd_max(bits, norm):
    mx.random.seed(bits)
    x = mx.random.normal((1, 2, 512, 128)) * mx.random.uniform(0.1, 10, (512, 1))
    decoded = codec_round(Codebook(bits, norm=norm), x)
    error = (((decoded - x) ** 2).sum(-1) / (x**2).sum(-1)).mean().item()
    assert error < 1.1 * lloyd_max(bits)[1]
    if norm == "length":
        lengths = mx.linalg.norm(decoded, axis=-1) / mx.linalg.norm(x, axis=-1)
        assert ((lengths - 1).abs() < 2e-3).all().item()


@pytest.mark.parametrize("bits,dim", itertools.product([3, 4, 5, 6], [64, 256]))
def test_dot_norm_keeps_scores_unbiased(bits, dim):
    mx.random.seed(bits * dim)
    keys = mx.random.normal((4096, dim))
    query = mx.random.normal((dim,))
    decoded = codec_round(Codebook(bits), keys)
    scores, errors = keys @ query, (decoded - keys) @ query
    slope = ((decoded @ query) * scores).sum() / (scores * scores).sum()
    assert abs(slope.item() - 1) < 0.01
    standard_error = mx.sqrt((errors * errors).mean() / errors.size)
    assert abs(errors.mean().item()) < 4 * standard_error.item()


@pytest.mark.parametrize(
    "bits,norm", itertools.product([3, 4, 5], ["dot", "length", "plain"])
)
def test_error_variance_predicts_the_error(bits, norm):
    mx.random.seed(bits)
    x = mx.random.normal((1, 2, 2048, 128)) * mx.random.uniform(0.1, 10, (2048, 1))
    c = Codebook(bits, norm=norm)
    page = c.encode(x)
    decoded = rotate(c.decode(page, mx.float32), "hadamard", inverse=True)
    error = ((decoded - x) ** 2).sum(-1).mean().item()
    predicted = (c.error_variance(page[1], 128) * 128).mean().item()
    # a rotated 128-vector's coordinates have lighter tails than a Gaussian's
    assert 0.9 < error / predicted < 1.02


def test_norm8_codes():
    x = mx.array([1e-3, 0.37, 1.0, 5.5, 123.4, 9000.0])
    back = decode_norm(encode_norm(x))
    assert ((back / x - 1).abs() < 0.033).all().item()
    c = Codebook(3, norm_bits=8)
    assert c.bits_per_element(64) == 3.125
    assert c.spec == "codebook-3-hadamard-dot-n8"
    x = mx.random.normal((1, 2, 5, 64))
    page = c.encode(x)
    assert page[1].dtype == mx.uint8
    assert c.empty_page(x, 7)[1].dtype == mx.uint8
    # an 8-bit norm adds at most its 3.3% to the 16-bit norm's error
    error16 = relative_error(codec_round(Codebook(3), x), x)
    assert relative_error(codec_round(c, x), x) < error16 + 0.04
    # and the expected error is read through the codes
    variance = c.error_variance(page[1], 64)
    assert variance.dtype == mx.float32 and variance.shape == (1, 2, 5, 1)


def test_codebook_encodes_pre_rotated_vectors_as_rotated_ones():
    x = mx.random.normal((1, 2, 9, 64), key=mx.random.key(3))
    c = Codebook(4)
    direct = c.encode(x)
    prerotated = c.encode(rotate(x, "hadamard"), rotated=True)
    for a, b in zip(direct, prerotated):
        assert (a == b).mean().item() > 0.99


# ---------------------------------------------------------------------------
# Affine and Plain


@pytest.mark.parametrize(
    "bits,group,rotation", [(8, 64, "none"), (4, 32, "hadamard"), (2, 128, "givens")]
)
def test_affine_is_mlx_quantization_after_the_rotation(bits, group, rotation):
    x = mx.random.normal((2, 3, 10, 128), key=mx.random.key(bits))
    c = Affine(bits, group, rotation)
    page = c.encode(x)
    want = mx.quantize(rotate(x, rotation), group_size=group, bits=bits)
    assert len(page) == c.parts == 3
    assert all(mx.array_equal(a, b) for a, b in zip(page, want))
    assert mx.array_equal(c.encode(rotate(x, rotation), rotated=True)[0], page[0])
    decoded = c.decode(page, mx.float32)
    assert mx.array_equal(decoded, mx.dequantize(*want, group_size=group, bits=bits))
    assert c.dim(page) == 128
    # within a step of the rotated values' range (half a step of a group's)
    step = (rotate(x, rotation).max() - rotate(x, rotation).min()) / (2**bits - 1)
    assert (decoded - rotate(x, rotation)).abs().max().item() < step.item()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_integer_offsets_decode_as_mlx_scales_and_biases(bits):
    """A word holds the scale (rounded up to what it keeps) and the zero point:
    the page decodes as ``mx.dequantize`` with those scales and biases
    (``scale * zero`` exact in float16), each value within half a step of
    its input and 0 exactly."""
    x = mx.random.normal((2, 3, 10, 64), key=mx.random.key(bits)) * 3
    x[..., :32] = mx.abs(x[..., :32])  # groups on one side of 0
    x[0, 0, 0] = 0
    c = Affine(bits, 32, offset="int")
    page = c.encode(x)
    packed, scales, biases = c.quantized(page, mx.float16)
    assert mx.all(scales > 0).item()
    want = mx.dequantize(packed, scales, biases, group_size=32, bits=bits)
    decoded = c.decode(page, mx.float32)
    assert mx.array_equal(decoded, want.astype(mx.float32))
    step = mx.repeat(scales.astype(mx.float32), 32, axis=-1)
    assert mx.all((decoded - x).abs() <= step / 2 + 1e-6).item()
    assert mx.all(decoded[0, 0, 0] == 0).item()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_every_offset_word_decodes_to_its_half_scale_and_zero_point(bits):
    """``scales_biases`` (compiled arithmetic) against the words' bits viewed
    as halves, for every word of a finite positive scale."""
    words = mx.arange(0x7C00, dtype=mx.uint32).astype(mx.uint16)
    scales, biases = scales_biases(words, bits, mx.float32)
    top = (1 << bits) - 1
    half = mx.view(words & (0xFFFF ^ top), mx.float16).astype(mx.float32)
    assert mx.array_equal(scales, half)
    assert mx.array_equal(biases, -(words & top).astype(mx.float32) * half)


def test_integer_offsets_in_groups_of_32_beat_float_ones_in_groups_of_64():
    """At the same 4.5 bits an element, a quarter less squared error."""
    x = mx.random.normal((4, 8, 64, 128), key=mx.random.key(0))
    errors = {}
    for c in (Affine(4, 64), Affine(4, 32, offset="int")):
        errors[c.offset] = relative_error(c.decode(c.encode(x), mx.float32), x)
        assert c.bits_per_element(128) == 4.5
    assert errors["int"] < 0.85 * errors["float"]


@pytest.mark.parametrize(
    "c",
    [
        Affine(8, 64),
        Affine(4, 32, "hadamard"),
        Affine(4, 32, offset="int"),
        Codebook(3),
    ],
)
@pytest.mark.parametrize("rows", [1, CPU_DEQUANTIZED_ROWS])
def test_scores_and_weigh_are_products_with_the_decoded_tile(c, rows):
    # few rows: mx.quantized_matmul; many: a product with the decoded tile
    mx.random.seed(rows)
    tile = c.encode(mx.random.normal((1, 2, 40, 64)))
    decoded = c.decode(tile, mx.float32)
    queries = mx.random.normal((1, 2, rows, 64))
    scores = c.scores(queries, tile)
    assert mx.allclose(scores, queries @ decoded.swapaxes(-1, -2), atol=1e-4)
    probs = mx.softmax(scores, axis=-1)
    assert mx.allclose(c.weigh(probs, tile), probs @ decoded, atol=1e-5)


def test_plain_stores_what_it_is_given():
    x = mx.random.normal((1, 2, 5, 64)).astype(mx.bfloat16)
    c = Plain()
    page = c.encode(x)
    assert page == (x,) and c.decode(page, mx.float32).dtype == mx.float32
    assert c.empty_page(x, 8)[0].shape == (1, 2, 8, 64)
    assert c.empty_page(x, 8)[0].dtype == mx.bfloat16
    assert c.rotation == "none" and c.parts == 1 and c.dim(page) == 64


@pytest.mark.parametrize(
    "c,dim,shapes",
    [
        (Affine(4, 64), 128, [((16,), mx.uint32), ((2,), None), ((2,), None)]),
        (Affine(8, 32), 64, [((16,), mx.uint32), ((2,), None), ((2,), None)]),
        (Affine(4, 32, offset="int"), 64, [((8,), mx.uint32), ((2,), mx.uint16)]),
        (Codebook(3), 128, [((12,), mx.uint32), ((1,), mx.float16)]),
        (Codebook(5), 64, [((10,), mx.uint32), ((1,), mx.float16)]),
        (Plain(), 64, [((64,), None)]),
    ],
)
def test_empty_pages_hold_what_encode_writes(c, dim, shapes):
    x = mx.zeros((2, 3, 1, dim), mx.bfloat16)
    page = c.empty_page(x, 32)
    encoded = c.encode(mx.random.normal((2, 3, 5, dim)).astype(mx.bfloat16))
    assert len(page) == len(encoded) == c.parts == len(shapes)
    for empty, written, (width, dtype) in zip(page, encoded, shapes):
        assert empty.shape == (2, 3, 32, *width)
        assert empty.dtype == written.dtype == (dtype or mx.bfloat16)
        assert written.shape == (2, 3, 5, *width)


# ---------------------------------------------------------------------------
# Bits per element


@pytest.mark.parametrize(
    "c,dim,bits",
    [
        (Affine(4, 64), 128, 4.5),
        (Affine(8, 32), 64, 9.0),
        (Affine(3, 128), 128, 3.25),
        (Affine(4, 32, offset="int"), 64, 4.5),
        (Affine(2, 64, offset="int"), 128, 2.25),
        (Codebook(3), 128, 3.125),
        (Codebook(3), 64, 3.25),
        (Codebook(4, norm_bits=8), 64, 4.125),
        (Plain(), 64, 16.0),
    ],
)
def test_bits_per_element(c, dim, bits):
    assert c.bits_per_element(dim) == bits
    if isinstance(c, Codebook) or getattr(c, "offset", "") == "int":
        # what a page costs, its norms in float16 (or uint8), its words
        page = c.encode(mx.random.normal((1, 2, 10, dim)))
        stored = sum(x.nbytes for x in page) * 8 / (2 * 10 * dim)
        assert stored == bits


# ---------------------------------------------------------------------------
# Specs and settings


def test_codec_specs_round_trip():
    for c in (
        Codebook(3),
        Codebook(4, "givens", "plain"),
        Codebook(4, norm_bits=8),
        Codebook(4, debias=True),
        Codebook(5, debias=3.5),
        Codebook(2, "none", "length", 8, 2.0),
        Affine(4, 32),
        Affine(8, 128, "hadamard"),
        Affine(4, 32, "hadamard", "int"),
        Plain(),
    ):
        assert codec(c.spec) == c
        assert codec(c) is c
    assert Codebook(4, debias=True).spec == "codebook-4-hadamard-dot-debias"
    assert Codebook(5, debias=3.5).spec == "codebook-5-hadamard-dot-debias3.5"
    assert Affine(4, 32).spec == "affine-4-32-none"
    assert Affine(4, 32, offset="int").spec == "affine-4-32-none-int"
    assert codec(3) == Codebook(3)


@pytest.mark.parametrize(
    "spec", ["codebook-3-diagonal-dot", "affine-4", "codebook-3", "float16", ""]
)
def test_unknown_codec_specs_are_refused(spec):
    with pytest.raises(ValueError):
        codec(spec)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: Affine(7), "bits must be one of"),
        (lambda: Affine(1), "bits must be one of"),
        (lambda: Affine(4, 48), "group size must be one of"),
        (lambda: Affine(4, offset="half"), "offset must be one of"),
        (lambda: Affine(3, offset="int"), "offset=int takes bits 2, 4 or 8"),
        (lambda: Codebook(0), "Codebook bits must be 1 to 6"),
        (lambda: Codebook(7), "Codebook bits must be 1 to 6"),
        (lambda: Codebook(3, norm="unit"), "Unknown norm 'unit'"),
        (lambda: Codebook(3, norm_bits=12), "norm_bits must be 8 or 16"),
        (lambda: Codebook(4, debias=-1.0), "debias must be 0 or more"),
        # a spec of settings a codec refuses
        (lambda: codec("affine-7-64-none"), "bits must be one of"),
        (lambda: codec("codebook-9-hadamard-dot"), "Codebook bits must be 1 to 6"),
    ],
)
def test_bad_settings_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "c,dim,match",
    [
        (Affine(4, 64), 96, "not a multiple of the group size 64"),
        (Affine(4, 128), 64, "not a multiple of the group size 128"),
        (Codebook(3), 48, "3-bit packing needs a multiple of 32"),
        (Codebook(6), 40, "6-bit packing needs a multiple of 16"),
    ],
)
def test_head_dims_a_codec_cannot_store(c, dim, match):
    with pytest.raises(ValueError, match=match):
        c.check_dim(dim)
    c.check_dim(128)


@pytest.mark.parametrize(
    "c,dim,want",
    [
        (Affine(4, 64, "hadamard"), 128, Affine(4, 64, "hadamard")),
        (Affine(4, 64, "hadamard"), 96, Affine(4, 32, "hadamard")),
        (Affine(8, 128), 192, Affine(8, 64)),
        (Affine(4, 32), 96, Affine(4, 32)),
        (Affine(4, 64, offset="int"), 96, Affine(4, 32, offset="int")),
        (Affine(4, 64), 80, "plain"),
        (Affine(4, 32), 16, "plain"),
        (Codebook(3), 48, "plain"),
    ],
)
def test_a_head_dim_a_codec_cannot_store_gets_what_can(c, dim, want):
    """``for_dim``: a smaller group size that divides the head dim, else
    unquantized; never a larger group (coarser than asked)."""
    got = for_dim(c, dim)
    assert (got.spec if want == "plain" else got) == want
    got.check_dim(dim)
