"""CUDA kernels of the codebook cache (omlx_cache.codebook_kernel).

On the CPU: the 3-bit sign-magnitude layout, the kernel's way of turning
codes into pairs of halves (emulated in numpy from the kernel's own
constants), that the kernels stay out of the way, and the decode buffer's
bookkeeping (held tokens encoded before anything reads the pages). On CUDA:
each kernel against the MLX-ops codec and float32 attention over the
cache's decoded keys and values."""

import itertools
import re

import mlx.core as mx
import numpy as np
import pytest
from kv_helpers import relative_error
from mlx_lm.models import base
from mlx_lm.models import quantized_decode as qd

from omlx_cache import codebook_kernel
from omlx_cache.codebook import (
    BatchCodebookKVCache,
    Codebook,
    CodebookKVCache,
    lloyd_max,
    pack,
    rotate,
    sign_magnitude_3bit,
    split_5bit,
    unpack,
)

ON_CUDA = codebook_kernel._cuda_available() and mx.default_device() == mx.gpu
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs CUDA (sm_80 or later)")


def test_three_bit_layout_is_sign_and_magnitude():
    # element 0: magnitude in word 0 bits 0-1, sign in word 2 bit 0; element
    # 4 (same pair): magnitude bits 8-9, sign bit 16; element 16: word 1
    assert [a[0] for a in sign_magnitude_3bit()] == [0, 0, 0]
    assert [a[4] for a in sign_magnitude_3bit()] == [0, 8, 16]
    assert [a[16] for a in sign_magnitude_3bit()] == [1, 0, 8]
    indices = np.zeros((32,), np.uint32)
    indices[4] = 4  # the smallest positive level: magnitude 0, sign 1
    indices[16] = 0  # the most negative: magnitude 3, sign 0
    words = np.array(pack(mx.array(indices), 3))
    assert words[2] == (1 << 16)
    assert words[1] & 3 == 3
    assert (np.array(unpack(mx.array(words), 3)) == indices).all()


def test_prefill_decodes_pages_by_ops_up_to_the_length():
    codec = Codebook(5)
    x = mx.random.normal((1, 2, 40, 64), key=mx.random.key(0))
    pages = [codec.encode(x[:, :, :16]), codec.encode(x[:, :, 16:])]
    want = rotate(codec.decode(codec.encode(x), mx.float32), "hadamard", True)
    with codebook_kernel.decoding_by_ops():
        # pages of 16 and 24 tokens: 14 of the second read
        out = codebook_kernel._dequantize_pages(pages, codec, 30, mx.float32)
    assert out.shape == (1, 2, 30, 64)
    assert mx.allclose(out, want[:, :, :30], atol=1e-5).item()


def test_five_bit_layout_splits_off_the_high_bits():
    # the low four bits as 4-bit packing; high bits of elements 0 and 4 at
    # bits 0 and 16 of word 4, of element 9 (word 1, nibble 1) at bit 5
    assert list(split_5bit()[[0, 4, 9, 31]]) == [0, 16, 5, 31]
    indices = np.arange(32, dtype=np.uint32)
    words = np.array(pack(mx.array(indices), 5))
    assert (words[:4] == np.array(pack(mx.array(indices & 15), 4))).all()
    assert words[4] == sum(1 << int(s) for s in split_5bit()[16:])
    assert (np.array(unpack(mx.array(words), 5)) == indices).all()


def _byte_perm(x, y, s):
    b = [(x >> (8 * i)) & 255 for i in range(4)] + [
        (y >> (8 * i)) & 255 for i in range(4)
    ]
    return sum(b[(s >> (4 * n)) & 7] << (8 * n) for n in range(4))


class _Emulated:
    """The kernel's cb3_pair / cb4_pair / cb5_pair in numpy, with its
    constants."""

    def __init__(self):
        header = codebook_kernel._header()
        self.c = {k: int(v) for k, v in re.findall(r"#define (CB\w+) (\d+)u", header)}

    def cb3(self, w, s, neg):
        sel = (((w >> s) & 0x0303) * 0x22 + 0x1010) & 0xFFFFFFFF
        return _byte_perm(self.c["CB3_LO"], self.c["CB3_HI"], sel) ^ neg

    @staticmethod
    def neg(z, shift):
        return ~(z << shift) & 0x80008000

    def cb4(self, t):
        flip = (((~t & 0xFFFFFFFF) >> 3) & 0x00010001) * 7
        mag = (t & 0x00070007) ^ flip
        low = mag & 0x00030003
        sel = (((low | (low >> 8)) & 0x0303) * 0x22 + 0x1010) & 0xFFFFFFFF
        lo = _byte_perm(self.c["CB4_0"], self.c["CB4_1"], sel)
        hi = _byte_perm(self.c["CB4_2"], self.c["CB4_3"], sel)
        mask = ((mag >> 2) & 0x00010001) * 0xFFFF
        neg = ((~t & 0xFFFFFFFF) << 12) & 0x80008000
        return ((lo & ~mask & 0xFFFFFFFF) | (hi & mask)) ^ neg

    def cb5(self, t):
        flip = (((~t & 0xFFFFFFFF) >> 4) & 0x00010001) * 15
        mag = (t & 0x000F000F) ^ flip
        low = mag & 0x00030003
        sel = (((low | (low >> 8)) & 0x0303) * 0x22 + 0x1010) & 0xFFFFFFFF
        parts = [
            _byte_perm(self.c[f"CB5_{2 * i}"], self.c[f"CB5_{2 * i + 1}"], sel)
            for i in range(4)
        ]
        odd = ((mag >> 2) & 0x00010001) * 0xFFFF
        upper = ((mag >> 3) & 0x00010001) * 0xFFFF
        lo = (parts[0] & ~odd & 0xFFFFFFFF) | (parts[1] & odd)
        hi = (parts[2] & ~odd & 0xFFFFFFFF) | (parts[3] & odd)
        neg = ((~t & 0xFFFFFFFF) << 11) & 0x80008000
        return ((lo & ~upper & 0xFFFFFFFF) | (hi & upper)) ^ neg


def _halves(u):
    return np.array([u & 0xFFFF, u >> 16], np.uint16).view(np.float16)


@pytest.mark.parametrize("bits,dim", itertools.product([3, 4, 5], [64, 128, 256]))
def test_kernel_reads_every_code_as_its_level(bits, dim):
    """The decode kernel's key and value operands, emulated lane by lane, are
    the levels of the packed indices at the dims the queries and the output
    give them."""
    em = _Emulated()
    levels = np.array(lloyd_max(bits)[0])
    idx = np.random.default_rng(bits * dim).integers(0, 1 << bits, (4, dim))
    words = np.array(pack(mx.array(idx.astype(np.uint32)), bits)).astype(np.int64)
    want = levels[idx].astype(np.float16)
    KC, STEPS, VC = dim // 4, dim // 16, dim // 8
    KHB = KC // 16
    seen_k, seen_v = set(), set()
    for pos in range(4):  # keys: a lane's quarter of a row
        for r, p in itertools.product(range(4), range(2 * STEPS)):
            a = pos * KC + 8 * (p // 4) + p % 4
            if bits == 3:
                h, kk, j = p // 8, (p % 8) // 4, p % 4
                gh = pos * KHB + h
                mag = words[r, (gh // 2) * 3 + gh % 2]
                sign = words[r, (gh // 2) * 3 + 2]
                pair = (gh & 1) * 8 + kk * 4 + j
                u = em.cb3(mag, 16 * kk + 2 * j, em.neg(sign, 15 - pair))
            elif bits == 5:
                # the kernel's k_first + k_word(i) and high_pair5
                w, j = p // 4, p % 4
                block = (pos * KC + 8 * w) // 32
                w_in = (pos * KC + 8 * w) % 32 // 8
                low = (words[r, block * 5 + w_in] >> (4 * j)) & 0x000F000F
                high = (words[r, block * 5 + 4] >> (4 * w_in + j)) & 0x00010001
                u = em.cb5(low | (high << 4))
            else:
                u = em.cb4(
                    (words[r, pos * (KC // 8) + p // 4] >> (4 * (p % 4))) & 0x000F000F
                )
            assert (_halves(u) == want[r, [a, a + 4]]).all()
            seen_k.update((a, a + 4))
    for quad in range(8):  # values: a lane's eighth of a row, two keys per operand
        start = quad * VC
        for g8, j, kp in itertools.product(range(VC // 8), range(4), range(2)):
            k0, k1 = 2 * kp, 2 * kp + 1
            d = start + 8 * g8 + j
            b0 = (((0 if VC >= 16 else start) + 8 * g8) % 16) // 4
            if bits == 3:
                hb = (start + 8 * g8) // 16
                mw = hb & 1
                mag = [words[k, (hb // 2) * 3 + mw] for k in (k0, k1)]
                sgn = [words[k, (hb // 2) * 3 + 2] for k in (k0, k1)]
                sel = b0 | ((b0 + 4) << 4) | ((b0 + 1) << 8) | ((b0 + 5) << 12)
                ssel = mw | ((mw + 2) << 4) | ((mw + 4) << 8) | ((mw + 6) << 12)
                y, z = _byte_perm(*mag, sel), _byte_perm(*sgn, ssel)
                q = (b0 // 2) * 4 + j
                a0 = em.cb3(y, 2 * j, em.neg(z, 15 - q))
                a1 = em.cb3(y, 16 + 2 * j, em.neg(z, 7 - q))
            elif bits == 5:
                # the kernel's v_first and v_signs words, the high bits at `at`
                first = (start // 32) * 5 + (start % 32) // 8
                w = [words[k, first + g8] for k in (k0, k1)]
                high = [words[k, (start // 32) * 5 + 4] for k in (k0, k1)]
                b, sh = j // 2, 4 * (j % 2)
                at = 4 * ((start % 32) // 8 + g8) + j
                a0, a1 = (
                    em.cb5(
                        ((_byte_perm(*w, sel) >> sh) & 0x000F000F)
                        | (((high[0] >> s) & 1) << 4)
                        | (((high[1] >> s) & 1) << 20)
                    )
                    for sel, s in (
                        (b | ((b + 4) << 8), at),
                        ((b + 2) | ((b + 6) << 8), at + 16),
                    )
                )
            else:
                w = [words[k, start // 8 + g8] for k in (k0, k1)]
                b, sh = j // 2, 4 * (j % 2)
                a0 = em.cb4((_byte_perm(*w, b | ((b + 4) << 8)) >> sh) & 0x000F000F)
                a1 = em.cb4(
                    (_byte_perm(*w, (b + 2) | ((b + 6) << 8)) >> sh) & 0x000F000F
                )
            for u, dd in ((a0, d), (a1, d + 4)):
                assert (_halves(u) == want[[k0, k1], dd]).all()
                seen_v.add(dd)
    assert seen_k == seen_v == set(range(dim))


def test_hadamard_rotation_is_sylvesters():
    """What the kernels compute (a fast Walsh-Hadamard transform) on every
    device: the normalised Hadamard matrix in Sylvester's order (checked on
    the CPU: CUDA's float32 matmuls round in TF32)."""
    i = np.arange(128)
    matrix = (-1.0) ** np.bitwise_count(i[:, None] & i[None]) / np.sqrt(128)
    x = mx.random.normal((3, 128))
    want = np.array(x) @ matrix
    with mx.stream(mx.cpu):
        assert np.allclose(np.array(rotate(x, "hadamard")), want, atol=1e-5)


def test_kernels_stay_out_of_the_way_off_cuda():
    cache = CodebookKVCache(3)
    k = mx.random.normal((1, 2, 40, 64))
    cache.update_and_fetch(k, k)
    q = mx.random.normal((1, 4, 1, 64))
    if not ON_CUDA:
        assert not codebook_kernel.encodes(k, cache.key_codec)
        assert not codebook_kernel.holds(k, k, cache.key_codec, cache.value_codec)
    with codebook_kernel.disabled():
        args = (q, cache.key_pages, cache.value_pages, cache.key_codec)
        assert not codebook_kernel.applies(
            *args, cache.value_codec, None, None, cache.offset
        )
    # givens, affine and plain codecs are never taken
    for codecs in ((Codebook(3, "givens"),) * 2, (3, "affine-4-64-hadamard")):
        other = CodebookKVCache(*codecs)
        other.update_and_fetch(k, k)
        args = (q, other.key_pages, other.value_pages, other.key_codec)
        assert not codebook_kernel.applies(
            *args, other.value_codec, None, None, other.offset
        )


def test_parts_of_the_kernels_switch_off_alone():
    with codebook_kernel.disabled("prefill"):
        assert codebook_kernel._disabled[-1] == {"prefill"}
        with codebook_kernel.disabled("decode"):
            assert codebook_kernel._disabled[-1] == {"prefill", "decode"}
        assert codebook_kernel._disabled[-1] == {"prefill"}
        with codebook_kernel.disabled():
            assert codebook_kernel._disabled[-1] == set(codebook_kernel.PARTS)
    assert not codebook_kernel._disabled[-1]
    with (
        pytest.raises(ValueError, match="Unknown kernel parts"),
        codebook_kernel.disabled("prefil"),
    ):
        pass


@pytest.mark.parametrize("mask", [None, "causal", "window", "additive"])
def test_blocked_attention_is_one_call_a_block_at_a_time(monkeypatch, mask):
    # the prefill's way past cuDNN (heads of 256): blocks of queries, each
    # with its rows of the mask (causal: the keys its last query sees)
    mx.random.seed(3)
    q = mx.random.normal((1, 4, 40, 32))
    k, v = mx.random.normal((2, 1, 2, 100, 32))
    if mask == "window":
        mask = base.create_causal_mask(40, 60, window_size=16)
    elif mask == "additive":
        mask = mx.random.normal((1, 1, 40, 100))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    monkeypatch.setattr(base, "QUANTIZED_SDPA_TILE_SCORES", 4 * 100 * 7)
    got = codebook_kernel._blocked_attention(q, k, v, 0.2, mask)
    # (float32 matmuls are TF32 on CUDA: both calls are ~1e-3 off float64)
    atol = 2e-3 if ON_CUDA else 1e-5
    assert np.allclose(np.array(got), np.array(want), atol=atol)


def test_prefill_is_fused_only_where_cudnn_takes_it():
    assert codebook_kernel._fused(128, mx.bfloat16)
    assert not codebook_kernel._fused(256, mx.bfloat16)
    assert not codebook_kernel._fused(64, mx.float32)


def test_kernels_take_only_float16_norms():
    # the kernels write and read float16 norms: 8-bit ones take the ops path
    assert codebook_kernel._rotates(Codebook(3)) is True
    assert codebook_kernel._rotates(Codebook(3, "none")) is False
    assert codebook_kernel._rotates(Codebook(3, norm_bits=8)) is None


def test_kernels_take_three_to_five_bits():
    assert codebook_kernel._rotates(Codebook(5)) is True
    assert codebook_kernel._rotates(Codebook(6)) is None
    assert codebook_kernel._rotates(Codebook(2)) is None


def test_decode_kernel_name_says_its_input_types():
    # MLX caches a compiled kernel by its name: inputs of other types need
    # another name, or they are read as the first call's types
    shape = (128, 4, 3, 3, True, True, 8, 0, False)
    names = {
        codebook_kernel._template(*shape, q, m, q)
        for q in (mx.float16, mx.bfloat16)
        for m in (mx.bool_, mx.float32)
    }
    assert len(names) == 4


def test_kernel_names_carry_their_code():
    # MLX's PTX cache on disk is keyed by name: edited code needs a new name
    source = codebook_kernel._DECODE_SOURCE
    name = codebook_kernel._compiled_name("codebook_sdpa_decode_1", source)
    assert name.startswith("codebook_sdpa_decode_1_")
    assert name == codebook_kernel._compiled_name("codebook_sdpa_decode_1", source)
    assert name != codebook_kernel._compiled_name(
        "codebook_sdpa_decode_1", source + " "
    )


def test_kernel_sources_compact_without_losing_code():
    # the decode and combine kernels are made per template with their source
    # compacted (patch 0023): comments go, no code does
    _, _, _, decode = codebook_kernel._decode_kernel(1, True)
    for source in (decode, codebook_kernel._COMBINE_SOURCE):
        compact = qd._compact(source)
        assert "//" not in compact and len(compact) < 0.8 * len(source)
        code = [line.split("//")[0].split() for line in source.splitlines()]
        assert [w for words in code for w in words] == compact.split()


@pytest.mark.parametrize("center", ["", "kv"])
def test_decode_buffer_changes_nothing_but_when_tokens_are_encoded(center):
    """Held decode tokens (forced on here; on CUDA by default) are encoded
    when the buffer fills and before state, trim or the ops path read the
    pages: what is stored and attended is the same as without a buffer.
    The ops path is taken on every device (the kernel keeps them held)."""
    with codebook_kernel.disabled():
        _check_decode_buffer(center)


def _check_decode_buffer(center):
    mx.random.seed(3)
    prompt = mx.random.normal((1, 2, 50, 64))
    steps = mx.random.normal((1, 2, 11, 64))
    caches = [CodebookKVCache(3, 4, center=center) for _ in range(2)]
    caches[1].decode_buffer = 4
    q = mx.random.normal((1, 4, 1, 64))
    for c in caches:
        c.update_and_fetch(prompt, prompt * 0.5)
    outs = [[], []]
    for t in range(11):
        for i, c in enumerate(caches):
            kv = c.update_and_fetch(steps[:, :, t : t + 1], steps[:, :, t : t + 1])
            if i == 1:
                # held, but outside the buffer until attention or a reader
                assert c.n_held == 1 and c.incoming is not None
            outs[i].append(c.scaled_dot_product_attention(q, *kv, 0.125, None))
            assert c.n_held == 0  # the ops path encodes what is held first
    for a, b in zip(*outs):
        assert mx.allclose(a, b, atol=1e-6)
    for t in range(5):  # the buffer fills at 4 tokens, encoded as a 5th comes
        for c in caches:
            c.update_and_fetch(steps[:, :, t : t + 1], steps[:, :, t : t + 1])
        assert caches[1].n_held == t % 4 + 1
    assert caches[1].offset == caches[0].offset == 66
    state = caches[1].state  # encodes the held token
    assert caches[1].n_held == 0
    for a, b in zip(caches[0].state[:2], state[:2]):
        assert all(mx.array_equal(x, y) for x, y in zip(a, b))
    restored = CodebookKVCache()
    restored.state = state
    assert restored.offset == 66
    caches[1].update_and_fetch(steps[:, :, :1], steps[:, :, :1])
    assert caches[1].trim(3) == 3 and caches[1].offset == 64
    assert caches[1].n_held == 0


# ---------------------------------------------------------------------------
# On CUDA


def _reference(queries, cache, scale, mask=None):
    """float32 attention over the cache's decoded keys and values, its held
    decode tokens as they came (the kernel reads them unquantized)."""
    n = cache.n_held
    if n:
        held = [
            x[:, :, :n].astype(mx.float32) for x in (cache.held_keys, cache.held_values)
        ]
        if cache.key_weights is not None:
            held[0] = held[0] / cache.key_weights
    keys, values = cache.dequantize(mx.float32)  # (encodes the held tokens)
    if n:
        for i, mean in enumerate((cache.key_mean, cache.value_mean)):
            if mean is not None:
                held[i] = held[i] + mean
        keys = mx.concatenate([keys[:, :, :-n], held[0]], axis=2)
        values = mx.concatenate([values[:, :, :-n], held[1]], axis=2)
    B, n_q, L, D = queries.shape
    n_kv = keys.shape[1]
    q = queries.astype(mx.float32).reshape(B, n_kv, n_q // n_kv * L, D)
    scores = ((q * scale) @ keys.swapaxes(-1, -2)).reshape(B, n_kv, n_q // n_kv, L, -1)
    if isinstance(mask, str):
        n = keys.shape[2]
        causal = mx.arange(n)[None] <= (mx.arange(L)[:, None] + n - L)
        scores = mx.where(causal, scores, -float("inf"))
    elif mask is not None:
        scores = mx.where(mask[:, :, None], scores, -float("inf"))
    out = mx.softmax(scores, axis=-1) @ values[:, :, None]
    return out.reshape(B, n_q, L, D)


@cuda_only
@pytest.mark.parametrize(
    "bits,dim,rotation",
    itertools.product([3, 4, 5], [64, 128, 256], ["hadamard", "none"]),
)
def test_encode_and_dequantize_kernels(bits, dim, rotation):
    codec = Codebook(bits, rotation)
    x = (mx.random.normal((2, 4, 33, dim)) * 3).astype(mx.float16)
    packed, norms = codec.encode(x)
    with codebook_kernel.disabled():
        ref_packed, ref_norms = codec.encode(x)
        ref = codebook_kernel.dequantize_by_ops(
            (ref_packed, ref_norms), codec, mx.float32
        )
    # the rotations round differently (the ops path in TF32 on CUDA): a
    # coordinate next to a cell edge may move
    assert (unpack(packed, bits) == unpack(ref_packed, bits)).mean().item() > 0.995
    assert relative_error(norms.astype(mx.float32), ref_norms.astype(mx.float32)) < 1e-2
    out = codebook_kernel.dequantize((ref_packed, ref_norms), codec, mx.float32)
    assert relative_error(out, ref) < 1e-3


@cuda_only
@pytest.mark.parametrize(
    "bits,heads,dim,tokens,page,center,settings",
    [
        ((3, 3), (32, 8), 128, 4097, 4096, "", {}),
        ((4, 4), (32, 8), 128, 3000, 1024, "kv", {}),
        ((3, 4), (16, 4), 256, 2500, 1024, "", {}),
        ((4, 3), (9, 3), 64, 777, 256, "k", {}),
        # pages of a size that is not a multiple of 16 (the kernel's tiles)
        ((3, 3), (32, 8), 128, 2100, 1000, "", {}),
        # kept first tokens, read unquantized by the decode kernel's first
        # block (their copies in the pages masked) and put in place of their
        # decoded copies in prefill; with key weights (the decode kernel
        # weighs the queries and the incoming token, and adds the value mean)
        ((3, 3), (32, 8), 128, 2100, 4096, "kv", {"keep_exact": 16, "key_scale": "qk"}),
        ((4, 3), (9, 3), 64, 777, 256, "k", {"keep_exact": 5, "key_scale": "q"}),
        # kept tokens in the first of 33 pages: two decode launches
        ((3, 3), (8, 2), 64, 4200, 128, "", {"keep_exact": 4}),
        # 5-bit keys (CQ4's layers) and values, each head dim's words per lane
        ((5, 4), (32, 8), 128, 3000, 1024, "", {}),
        ((5, 3), (16, 4), 256, 2500, 1024, "k", {}),
        ((5, 4), (9, 3), 64, 777, 256, "kv", {"keep_exact": 8, "key_scale": "q"}),
        ((4, 5), (32, 8), 128, 3000, 1024, "kv", {}),
        ((5, 5), (16, 4), 256, 2500, 1024, "", {"keep_exact": 8}),
        ((4, 5), (9, 3), 64, 777, 256, "kv", {"keep_exact": 8, "key_scale": "q"}),
    ],
)
def test_attention_kernels_against_float32(
    bits, heads, dim, tokens, page, center, settings
):
    mx.random.seed(tokens)
    cache = CodebookKVCache(*bits, page_size=page, center=center, **settings)
    cache.decode_buffer = 8
    n_q, n_kv = heads
    k = mx.random.normal((1, n_kv, tokens + 13, dim)).astype(mx.float16)
    v = mx.random.normal((1, n_kv, tokens + 13, dim)).astype(mx.float16)
    cache.update_and_fetch(k[:, :, :tokens], v[:, :, :tokens])
    q = mx.random.normal((1, n_q, 33, dim)).astype(mx.float16)
    out = cache.scaled_dot_product_attention(
        q, cache.key_pages, cache.value_pages, 0.1, "causal"
    )
    assert relative_error(out, _reference(q, cache, 0.1, "causal")) < 5e-3
    for t in range(tokens, tokens + 13):
        kv = cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        if t - tokens in (0, 5, 12):  # 1, then 6, then 7 tokens held
            q1 = mx.random.normal((1, n_q, 1, dim)).astype(mx.float16)
            out = cache.scaled_dot_product_attention(q1, *kv, 0.1, None)
            held = cache.n_held
            # the kernel wrote the incoming token into the buffer's next row
            assert cache.incoming is None
            came = k[:, :, t + 1 - held : t + 1]
            if cache.key_mean is not None:
                came = came - cache.key_mean
            if cache.key_weights is not None:
                came = came * cache.key_weights
            assert relative_error(cache.held_keys[:, :, :held], came) < 1e-3
            ref = _reference(q1, cache, 0.1)  # (encodes the held tokens)
            assert relative_error(out, ref) < 5e-3, (t, held)


@cuda_only
def test_prefill_over_heads_of_256_scores_in_float32():
    # cuDNN takes heads up to 128; past it MLX's scores would be bfloat16
    # (Gemma's passkeys went missing): the prefill attends in float32
    mx.random.seed(7)
    cache = CodebookKVCache(4, page_size=1024, center="k", keep_exact=8)
    k, v = (mx.random.normal((2, 1, 1, 3000, 256)) * 3).astype(mx.bfloat16)
    cache.update_and_fetch(k, v)
    q = (mx.random.normal((1, 4, 300, 256)) * 3).astype(mx.bfloat16)
    mask = base.create_causal_mask(300, 2700, window_size=512)[None, None]
    ref = _reference(q, cache, 0.0625, mask)
    pages = (cache.key_pages, cache.value_pages)
    out = cache.scaled_dot_product_attention(q, *pages, 0.0625, mask)
    with codebook_kernel.prefill_in(mx.bfloat16):
        bf16 = cache.scaled_dot_product_attention(q, *pages, 0.0625, mask)
    assert relative_error(out, ref) < 5e-3
    assert relative_error(bf16, ref) > 2 * relative_error(out, ref)


@cuda_only
def test_batched_decode_kernel_with_left_padding():
    cache = CodebookKVCache(3, page_size=4096)
    k = mx.random.normal((3, 8, 1500, 128)).astype(mx.float16)
    cache.update_and_fetch(k, k * 0.5)
    valid = mx.arange(1500)[None] >= mx.array([0, 100, 777])[:, None]
    mask = valid[:, None, None, :]
    q = mx.random.normal((3, 32, 1, 128)).astype(mx.float16)
    ref = _reference(q, cache, 0.1, mask)
    for m in (mask, mx.where(mask, 0.0, -1e9).astype(mx.float16)):
        out = cache.scaled_dot_product_attention(
            q, cache.key_pages, cache.value_pages, 0.1, m
        )
        assert relative_error(out, ref) < 5e-3


@cuda_only
def test_batched_decode_kernel_with_kept_tokens():
    """Each left-padded sequence keeps its first tokens after its padding:
    the decode kernel reads each sequence's own, as the ops path does."""
    mx.random.seed(7)
    padding = [0, 100, 777]
    cache = BatchCodebookKVCache(padding, 3, center="kv", keep_exact=8)
    k = mx.random.normal((3, 8, 1500, 128)).astype(mx.float16)
    cache.update_and_fetch(k, k * 0.5)
    token = mx.random.normal((3, 8, 1, 128)).astype(mx.float16)
    kv = cache.update_and_fetch(token, token)
    mask = (mx.arange(1501)[None] >= mx.array(padding)[:, None])[:, None, None, :]
    q = mx.random.normal((3, 32, 1, 128)).astype(mx.float16)
    codecs = (cache.key_codec, cache.value_codec)
    assert codebook_kernel.applies(q, *kv, *codecs, mask, None, 1501)
    out = cache.scaled_dot_product_attention(q, *kv, 0.1, mask)
    with codebook_kernel.disabled():
        ref = cache.scaled_dot_product_attention(q, *kv, 0.1, mask)
    assert relative_error(out, ref) < 5e-3


def test_decode_buffer_with_weighted_keys_and_kept_tokens():
    """Held decode tokens are weighted like the stored keys (their pages equal
    a cache's without a buffer); a cache keeping its first tokens holds
    decode tokens once those are stored, and stores the same."""
    mx.random.seed(5)
    prompt = mx.random.normal((1, 2, 40, 64))
    prompt_queries = mx.random.normal((1, 4, 40, 64))
    steps = mx.random.normal((1, 2, 6, 64))
    with codebook_kernel.disabled():
        caches = [CodebookKVCache(3, center="k", key_scale="q") for _ in range(2)]
        caches[1].decode_buffer = 4
        for c in caches:
            kv = c.update_and_fetch(prompt, prompt)
            c.scaled_dot_product_attention(prompt_queries, *kv, 0.125, "causal")
        for t in range(6):
            for c in caches:
                c.update_and_fetch(steps[:, :, t : t + 1], steps[:, :, t : t + 1])
        assert caches[1].n_held == 2
        states = [c.state for c in caches]
        for a, b in zip(states[0][:2], states[1][:2]):
            assert all(mx.array_equal(x, y) for x, y in zip(a, b))
        # kept first tokens: decode tokens are held once those are stored
        kept = [CodebookKVCache(3, keep_exact=n) for n in (4, 4, 42)]
        for c in kept[1:]:
            c.decode_buffer = 4
        for c in kept:
            c.update_and_fetch(prompt, prompt)
        for t in range(3):
            for c in kept:
                c.update_and_fetch(steps[:, :, t : t + 1], steps[:, :, t : t + 1])
        assert [c.n_held for c in kept] == [0, 3, 1]
        states = [c.state for c in kept[:2]]
        for a, b in zip(*states):
            a, b = (x if isinstance(x, tuple) else (x,) for x in (a, b))
            for x, y in zip(a, b):
                assert mx.array_equal(x, y) if isinstance(x, mx.array) else x == y
        assert kept[2].exact_keys.shape[2] == 42


@cuda_only
def test_decode_steps_share_one_plan():
    """A decode step's launches are planned once per kind of call: the steps
    after the first find their plan (host time a decode layer pays)."""
    cache = CodebookKVCache(3, page_size=4096)
    k = mx.random.normal((1, 8, 600, 128)).astype(mx.float16)
    cache.update_and_fetch(k, k)
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.float16)

    def step():
        t = mx.random.normal((1, 8, 1, 128)).astype(mx.float16)
        keys, values = cache.update_and_fetch(t, t)
        out = cache.scaled_dot_product_attention(q, keys, values, 0.1, None)
        mx.eval(out, cache.held_keys)
        return out

    step()
    step()
    hits = codebook_kernel._decode_plan.cache_info().hits
    for _ in range(3):
        step()
    assert codebook_kernel._decode_plan.cache_info().hits == hits + 3
    assert cache.n_held == 5
