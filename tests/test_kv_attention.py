"""The MLX-ops attention loop (``omlx_cache.kv.attention.ops_attention``)
against a float32 reference over the decoded pages.

The reference is plain attention over the keys and values the pages hold
(decoded, rotated back, unweighted and uncentered), with the first tokens
and the recent ones as a call gives them, so the only difference allowed is
float rounding: tiles, pages, the online softmax, GQA folding, masks, sinks
and the spans must not change the result."""

import itertools

import mlx.core as mx
import pytest
from kv_helpers import float_attention, relative_error
from mlx_lm.models.base import create_causal_mask

from omlx_cache.kv import Affine, Codebook, Plain, attention
from omlx_cache.kv.attention import (
    Call,
    First,
    Recent,
    attend,
    fold_queries,
    keys_per_tile,
    ops_attention,
    tile_scores,
    tiles,
)
from omlx_cache.kv.rotation import rotate

PAGE = 64
CODECS = {
    "affine-8,4": (Affine(8, 64), Affine(4, 64)),
    "affine-4-rotated": (Affine(4, 32, "hadamard"), Affine(4, 32, "hadamard")),
    "codebook-3,4": (Codebook(3), Codebook(4)),
    "codebook-4-givens": (Codebook(4, "givens"), Codebook(4, "givens")),
    "codebook-3k-affine4v": (Codebook(3), Affine(4, 64)),
    "codebook-3k-plain-v": (Codebook(3), Plain()),
}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    # tiles of 512 scores: even short contexts cross many tiles and pages
    monkeypatch.setattr(attention, "TILE_SCORES", 512)


def paged(codec, x, page_size=PAGE, noise=True):
    """``x`` (B, heads, T, D) encoded into pages of ``page_size`` rows; the
    rows past T are loud noise, which attention must not read."""
    pages = []
    T = x.shape[2]
    for start in range(0, T, page_size):
        chunk = x[:, :, start : start + page_size]
        n = chunk.shape[2]
        if n < page_size and noise:
            shape = (*x.shape[:2], page_size - n, x.shape[3])
            tail = 50 * mx.random.normal(shape, key=mx.random.key(T))
            chunk = mx.concatenate([chunk, tail.astype(x.dtype)], axis=2)
        page = codec.empty_page(x, page_size)
        for dst, src in zip(page, codec.encode(chunk)):
            dst[:, :, : chunk.shape[2]] = src
        pages.append(page)
    return pages


def decoded(codec, pages, length):
    """The first ``length`` rows the pages hold, in the codec's rotated domain."""
    parts = [codec.decode(page, mx.float32) for page in pages]
    return mx.concatenate(parts, axis=2)[:, :, :length]


def make_call(
    codecs,
    B=1,
    n_q=4,
    n_kv=2,
    L=1,
    length=100,
    D=64,
    mask=None,
    seed=0,
    **extra,
):
    """A call over ``length`` random stored tokens with ``L`` queries, and
    the float32 keys and values (rotated back) that the pages hold."""
    mx.random.seed(seed)
    key_codec, value_codec = codecs
    keys = mx.random.normal((B, n_kv, length, D)) + mx.random.normal((1, n_kv, 1, D))
    values = mx.random.normal((B, n_kv, length, D))
    queries = mx.random.normal((B, n_q, L, D))
    k_pages, v_pages = paged(key_codec, keys), paged(value_codec, values)
    call = Call(
        queries,
        D**-0.5,
        mask,
        extra.pop("sinks", None),
        key_codec,
        value_codec,
        k_pages,
        v_pages,
        length,
        **extra,
    )
    k = rotate(decoded(key_codec, k_pages, length), key_codec.rotation, inverse=True)
    v = rotate(decoded(value_codec, v_pages, length), value_codec.rotation, True)
    return call, k, v


def causal(L, total):
    return create_causal_mask(L, total - L)


# ---------------------------------------------------------------------------
# Tiles


@pytest.mark.parametrize(
    "page_size,length,tile", [(257, 257, 64), (300, 77, 32), (13, 13, 8), (5, 5, 8)]
)
def test_tiles_cover_each_key_once_and_stay_aligned(page_size, length, tile):
    seen = []
    for start, new, stop in tiles(page_size, length, tile):
        assert start <= new < stop <= page_size
        assert (stop - start) % 8 == 0 or stop - start == page_size
        seen.extend(range(new, stop))
    assert seen[: min(length, page_size)] == list(range(min(length, page_size)))
    assert len(set(seen)) == len(seen)


def test_tiles_stop_near_the_stored_keys():
    # a part-filled page costs what it holds, rounded up to 64 keys
    assert list(tiles(4096, 100, 4096)) == [(0, 0, 128)]
    assert list(tiles(4096, 128, 64)) == [(0, 0, 64), (64, 64, 128)]


def test_keys_per_tile_is_a_power_of_two_within_a_page(monkeypatch):
    monkeypatch.setattr(attention, "TILE_SCORES", None)
    assert tile_scores() == 1 << 24  # off CUDA
    assert keys_per_tile(1, 4096) == 4096
    assert keys_per_tile(3 * 1024, 1 << 20) == 4096
    monkeypatch.setattr(attention, "TILE_SCORES", 1000)
    assert keys_per_tile(10, 4096) == 64
    # never below 8 keys
    assert keys_per_tile(10_000, 4096) == 8


def test_fold_queries_makes_heads_rows():
    x = mx.arange(2 * 6 * 3).reshape(2, 6, 3, 1)
    folded = fold_queries(x, 2)
    assert folded.shape == (2, 2, 9, 1)
    # query heads 0-2 share key head 0, in order, each with its 3 rows
    assert mx.array_equal(folded[:, 0], x[:, :3].reshape(2, 9, 1))
    assert fold_queries(x, 6) is x


# ---------------------------------------------------------------------------
# Against the reference


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize(
    "D,groups,length", [(64, 1, 1), (64, 3, 65), (128, 4, 203), (256, 8, 150)]
)
def test_decode_matches_reference(name, D, groups, length):
    call, k, v = make_call(CODECS[name], n_q=2 * groups, D=D, length=length)
    out = ops_attention(call)
    assert out.shape == call.queries.shape and out.dtype == mx.float32
    assert relative_error(out, float_attention(call.queries, k, v)) < 1e-4


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("groups,length,L", [(1, 37, 37), (3, 203, 37), (4, 150, 20)])
def test_prefill_chunk_matches_reference(name, groups, length, L):
    call, k, v = make_call(
        CODECS[name], n_q=2 * groups, L=L, length=length, mask="causal", seed=L
    )
    ref = float_attention(call.queries, k, v, "causal")
    assert relative_error(ops_attention(call), ref) < 1e-4


@pytest.mark.parametrize("tile", [8, 16, 40, None])
def test_tiles_of_any_size_give_the_same_output(monkeypatch, tile):
    # TILE_SCORES from 8 keys a tile (the least) to whole pages
    scores = None if tile is None else tile * 6 * 30
    monkeypatch.setattr(attention, "TILE_SCORES", scores)
    call, k, v = make_call(CODECS["codebook-3,4"], n_q=6, L=30, length=150)
    call.mask = "causal"
    ref = float_attention(call.queries, k, v, "causal")
    assert relative_error(ops_attention(call), ref) < 1e-4


@pytest.mark.parametrize("kind", ["bool", "additive", "per-head"])
def test_array_masks_with_batch(kind):
    mx.random.seed(7)
    B, n_kv, groups, length, L = 3, 2, 4, 150, 20
    heads = n_kv * groups if kind == "per-head" else 1
    visible = mx.random.uniform(shape=(B, heads, L, length)) > 0.5
    mask = causal(L, length) & (visible | (mx.arange(length) == 0))
    if kind == "additive":
        mask = mx.where(mask, 0.0, -float("inf"))
    call, k, v = make_call(
        CODECS["affine-8,4"], B=B, n_q=n_kv * groups, n_kv=n_kv, L=L, length=length
    )
    call.mask = mask
    ref = float_attention(call.queries, k, v, mask)
    assert relative_error(ops_attention(call), ref) < 1e-4


def test_left_padded_batch_decode():
    # each sequence's keys from its own row on (a batch's decode mask)
    padding = mx.array([0, 40, 99])
    mask = (mx.arange(120)[None] >= padding[:, None])[:, None, None, :]
    call, k, v = make_call(CODECS["codebook-3,4"], B=3, n_q=8, length=120, mask=mask)
    ref = float_attention(call.queries, k, v, mask)
    assert relative_error(ops_attention(call), ref) < 1e-4


@pytest.mark.parametrize("mask", [None, "causal"])
def test_attention_sinks(mask):
    L = 9 if mask else 1
    sinks = mx.random.normal((6,), key=mx.random.key(1)) * 3
    call, k, v = make_call(
        CODECS["codebook-3,4"], n_q=6, L=L, length=100, mask=mask, sinks=sinks
    )
    ref = float_attention(call.queries, k, v, mask, sinks)
    assert relative_error(ops_attention(call), ref) < 1e-4


def test_queries_that_see_no_key_give_zeros():
    # a left-padded sequence's padding rows: no visible key, no NaN
    mask = mx.zeros((1, 1, 4, 70), mx.bool_)
    call, _, _ = make_call(CODECS["affine-8,4"], L=4, length=70, mask=mask)
    out = ops_attention(call)
    assert not mx.isnan(out).any().item() and not out.any().item()


# ---------------------------------------------------------------------------
# The spans: first tokens, recent tokens


def first_tokens(call, count, first=0, seed=1):
    """Unquantized first tokens for the call (rotated domain) and the same
    rotated back, for the reference."""
    B, D = call.queries.shape[0], call.queries.shape[-1]
    n_kv = (call.key_pages[0][0] if call.key_pages else call.recent.keys).shape[1]
    mx.random.seed(seed)
    keys = mx.random.normal((B, n_kv, count, D)) * 3
    values = mx.random.normal((B, n_kv, count, D))
    rotated = (
        rotate(keys, call.key_codec.rotation),
        rotate(values, call.value_codec.rotation),
    )
    return First(*rotated, first, count), (keys, values)


@pytest.mark.parametrize("name", ["affine-4-rotated", "codebook-3k-affine4v"])
@pytest.mark.parametrize("L", [1, 30])
def test_first_tokens_are_read_instead_of_their_pages_rows(name, L):
    mask = "causal" if L > 1 else None
    call, k, v = make_call(CODECS[name], n_q=6, L=L, length=140, mask=mask)
    call.first, (fk, fv) = first_tokens(call, 16)
    k[:, :, :16], v[:, :, :16] = fk, fv
    ref = float_attention(call.queries, k, v, mask)
    assert relative_error(ops_attention(call), ref) < 1e-4


@pytest.mark.parametrize("L", [1, 12])
def test_each_sequences_first_tokens_after_its_padding(L):
    # (B,) rows: each sequence's first tokens where its padding ends
    padding = mx.array([0, 7, 30])
    B, length = 3, 90
    visible = mx.arange(length)[None] >= padding[:, None]
    mask = visible[:, None, None, :] & causal(L, length)
    call, k, v = make_call(CODECS["codebook-3,4"], B=B, n_q=4, L=L, length=length)
    call.mask = mask
    call.first, (fk, fv) = first_tokens(call, 8, first=padding)
    for i, p in enumerate(padding.tolist()):
        k[i, :, p : p + 8], v[i, :, p : p + 8] = fk[i], fv[i]
    ref = float_attention(call.queries, k, v, mask)
    assert relative_error(ops_attention(call), ref) < 1e-4


@pytest.mark.parametrize("L", [1, 12])
@pytest.mark.parametrize("length", [32, 0])
def test_each_sequences_first_tokens_past_the_pages_are_the_recent_ones(L, length):
    """(B,) rows: first tokens the pages do not hold yet (a residual holds
    them: rows from ``length`` on) are read from the recent tokens, as a
    single sequence's are (and the affine decode kernel's ``first_tokens_mask``):
    the first span's copies of those rows are not read, nor hidden."""
    padding = mx.array([0, 30]) if length else mx.array([0, 3])
    B, n = 2, 10
    total = length + n
    visible = mx.arange(total)[None] >= padding[:, None]
    mask = visible[:, None, None, :] & causal(L, total)
    codec = CODECS["affine-4-rotated"]
    if length:
        call, k, v = make_call(codec, B=B, n_q=4, L=L, length=length)
    else:  # a residual not yet full: no page at all
        queries = mx.random.normal((B, 4, L, 64), key=mx.random.key(3))
        call = Call(queries, 0.125, None, None, *codec, [], [], 0)
        k = v = mx.zeros((B, 2, 0, 64))
    call.mask = mask
    held = mx.random.normal((2, B, 2, n, 64), key=mx.random.key(4))
    call.recent = Recent(*(rotate(x, "hadamard") for x in held), n)
    call.first, (fk, fv) = first_tokens(call, 8, first=padding)
    k, v = (mx.concatenate([x, h], axis=2) for x, h in zip((k, v), held))
    for i, p in enumerate(padding.tolist()):
        m = min(8, length - p) if length > p else 0
        k[i, :, p : p + m], v[i, :, p : p + m] = fk[i, :, :m], fv[i, :, :m]
    ref = float_attention(call.queries, k, v, mask, scale=call.scale)
    out = ops_attention(call)
    # (padding rows of the queries see no key: zeros, left out)
    seen = mask.any(axis=-1, keepdims=True)
    assert relative_error(mx.where(seen, out, 0), mx.where(seen, ref, 0)) < 1e-4


def test_first_tokens_the_pages_dropped_with_their_own_mask():
    # a window's sinks: out of the pages (first < 0), visible by their mask
    call, k, v = make_call(CODECS["affine-8,4"], L=5, length=60, mask="causal")
    first, (fk, fv) = first_tokens(call, 4, first=-100)
    visible = mx.array([True, False, True, True])
    call.first = first._replace(mask=mx.broadcast_to(visible, (1, 1, 5, 4)))
    mask = mx.concatenate([mx.broadcast_to(visible, (5, 4)), causal(5, 60)], axis=1)
    keys, values = (mx.concatenate(x, axis=2) for x in ((fk, k), (fv, v)))
    ref = float_attention(call.queries, keys, values, mask)
    assert relative_error(ops_attention(call), ref) < 1e-4


@pytest.mark.parametrize("rotated", [True, False])
@pytest.mark.parametrize("L", [1, 10])
def test_recent_tokens_follow_the_pages(rotated, L):
    codecs = CODECS["affine-4-rotated"]
    n = 24
    call, k, v = make_call(codecs, n_q=4, L=L, length=70)
    held = mx.random.normal((2, 1, 2, 32, 64), key=mx.random.key(5))
    keys, values = held[0], held[1]
    if rotated:
        keys = rotate(keys, codecs[0].rotation)
        values = rotate(values, codecs[1].rotation)
    call.recent = Recent(keys, values, n, rotated)
    call.mask = "causal" if L > 1 else None
    k = mx.concatenate([k, held[0][:, :, :n]], axis=2)
    v = mx.concatenate([v, held[1][:, :, :n]], axis=2)
    assert call.total == 70 + n
    ref = float_attention(call.queries, k, v, call.mask)
    assert relative_error(ops_attention(call), ref) < 1e-4


def test_only_recent_tokens():
    # a residual not yet full: no page at all
    held = mx.random.normal((2, 1, 2, 16, 64), key=mx.random.key(6))
    queries = mx.random.normal((1, 4, 3, 64), key=mx.random.key(7))
    codec = Affine(4, 64, "hadamard")
    call = Call(queries, 0.125, "causal", None, codec, codec, [], [], 0)
    call.recent = Recent(rotate(held[0], "hadamard"), rotate(held[1], "hadamard"), 11)
    ref = float_attention(
        queries, held[0][:, :, :11], held[1][:, :, :11], "causal", scale=0.125
    )
    assert relative_error(ops_attention(call), ref) < 1e-4


# ---------------------------------------------------------------------------
# Transforms and debias


@pytest.mark.parametrize("center", ["k", "kv"])
def test_means_and_key_weights_are_undone(center):
    # pages of (k - m) * w: scores q / w . (k - m) w + q . m; outputs plus m_v
    mx.random.seed(8)
    B, n_kv, D, length, L = 2, 2, 64, 90, 9
    keys = mx.random.normal((B, n_kv, length, D)) + 3
    values = mx.random.normal((B, n_kv, length, D)) - 2
    key_mean = keys.mean(axis=2, keepdims=True)
    value_mean = values.mean(axis=2, keepdims=True) if center == "kv" else None
    weights = mx.random.uniform(0.5, 2, (B, n_kv, 1, D))
    stored_values = values - value_mean if center == "kv" else values
    codec = Plain()
    queries = mx.random.normal((B, 6, L, D))
    call = Call(
        queries,
        D**-0.5,
        "causal",
        None,
        codec,
        codec,
        paged(codec, (keys - key_mean) * weights),
        paged(codec, stored_values),
        length,
        key_mean=key_mean,
        value_mean=value_mean,
        key_weights=weights,
    )
    ref = float_attention(queries, keys, values, "causal")
    assert relative_error(ops_attention(call), ref) < 1e-5


def test_sinks_with_centered_keys_shift_and_with_centered_values_fail():
    mx.random.seed(11)
    keys, values = mx.random.normal((2, 1, 2, 50, 64)) + 4
    queries = mx.random.normal((1, 6, 5, 64))
    sinks = mx.random.normal((6,)) * 3
    mean = keys.mean(axis=2, keepdims=True)
    codec = Plain()
    call = Call(
        queries,
        0.125,
        "causal",
        sinks,
        codec,
        codec,
        paged(codec, keys - mean),
        paged(codec, values),
        50,
        key_mean=mean,
    )
    ref = float_attention(queries, keys, values, "causal", sinks)
    assert relative_error(ops_attention(call), ref) < 1e-5
    call.value_mean = values.mean(axis=2, keepdims=True)
    with pytest.raises(ValueError, match="sinks"):
        ops_attention(call)


def debiased(call, k, v, mask, first=0):
    """The reference with each quantized key's score less half its expected
    error variance (``Codebook.debias``); the first ``first`` keys exact."""
    queries = call.queries
    _, n_q, L, D = queries.shape
    length = call.length
    norms = mx.concatenate([page[1] for page in call.key_pages], axis=2)
    variance = call.key_codec.error_variance(norms[:, :, :length], D)[..., 0]
    variance = mx.where(mx.arange(length) < first, 0, variance)
    variance = mx.repeat(variance, n_q // k.shape[1], axis=1)
    energy = (queries * queries).sum(-1, keepdims=True) * call.scale**2
    bias = -0.5 * float(call.key_codec.debias) * energy * variance[:, :, None, :]
    if mask == "causal":
        bias = mx.where(causal(L, length), bias, -float("inf"))
    return float_attention(queries, k, v, bias, scale=call.scale)


@pytest.mark.parametrize(
    "L,groups,strength", [(1, 1, True), (1, 4, True), (29, 3, True), (29, 3, 3.5)]
)
def test_debias_matches_its_reference(L, groups, strength):
    mask = "causal" if L > 1 else None
    codecs = (Codebook(3, debias=strength), Codebook(4))
    call, k, v = make_call(codecs, n_q=2 * groups, L=L, length=150, mask=mask)
    call.queries = call.queries * 3
    call.first, (fk, fv) = first_tokens(call, 4)
    k[:, :, :4], v[:, :, :4] = fk, fv
    want = debiased(call, k, v, mask, first=4)
    assert relative_error(ops_attention(call), want) < 1e-4
    # and the correction is not nothing
    assert relative_error(float_attention(call.queries, k, v, mask), want) > 1e-3


def test_debias_keeps_an_exact_tokens_weight():
    # many keys whose scores are near the query's typical score, and one
    # exact token (a sink): without the correction their score errors,
    # averaging exp(variance / 2) > 1, take weight from the sink
    mx.random.seed(0)
    D, S = 64, 4096
    queries = mx.random.normal((1, 8, 1, D))
    queries = queries / mx.linalg.norm(queries, axis=-1, keepdims=True) * 4
    keys = mx.random.normal((1, 8, S, D)) * 0.5
    keys[:, :, 0] = queries[:, :, 0] * 0.4
    values = mx.zeros((1, 8, S, D))
    values[:, :, 0, -1] = 1.0
    truth = mx.softmax((queries @ keys.swapaxes(-1, -2))[..., 0, :], axis=-1)
    truth = truth[..., 0].mean().item()
    weights = {}
    for debias in (False, True):
        key_codec = Codebook(2, debias=debias)
        value_codec = Plain()
        call = Call(
            queries,
            1.0,
            None,
            None,
            key_codec,
            value_codec,
            paged(key_codec, keys, 4096),
            paged(value_codec, values, 4096),
            S,
            first=First(rotate(keys[:, :, :1], "hadamard"), values[:, :, :1], 0, 1),
        )
        weights[debias] = ops_attention(call)[..., -1].mean().item()
    assert weights[False] < 0.97 * truth
    assert abs(weights[True] - truth) < 0.3 * abs(weights[False] - truth)


# ---------------------------------------------------------------------------
# The workspace and precision


def test_prefill_workspace_does_not_grow_with_context(monkeypatch):
    monkeypatch.setattr(attention, "TILE_SCORES", 1 << 20)

    def workspace(length):
        codec = Codebook(3)
        call, _, _ = make_call((codec, codec), n_q=8, L=128, length=length)
        call.mask = "causal"
        mx.eval(call.key_pages, call.value_pages, call.queries)
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        mx.eval(ops_attention(call))
        return mx.get_peak_memory() - before

    # 1,024-key tiles: one tile against four
    assert workspace(4096) < 1.1 * workspace(1024)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("L", [1, 32])
def test_half_precision_within_twice_sdpa(monkeypatch, dtype, L):
    """In half precision the loop (float32 scores and softmax) is at least as
    close to float32 attention over the pages' exact content as
    mx.fast.scaled_dot_product_attention over the dequantized keys and
    values in that dtype (within 2x); the quantization error dwarfs both."""
    monkeypatch.setattr(attention, "TILE_SCORES", None)
    mx.random.seed(L)
    n_q, n_kv, D, S = 8, 2, 64, 256
    keys = mx.random.normal((1, n_kv, S, D))
    # two outlier channels, as real keys have
    channel = mx.arange(D)
    keys = keys + mx.where(channel == 5, 20.0, 0) - mx.where(channel == 44, 15.0, 0)
    values = mx.random.normal((1, n_kv, S, D))
    queries = mx.random.normal((1, n_q, L, D))
    queries, keys, values = (x.astype(dtype) for x in (queries, keys, values))
    codec = Affine(8, 64)
    k_pages, v_pages = paged(codec, keys, 4096), paged(codec, values, 4096)
    mask = "causal" if L > 1 else None
    call = Call(queries, D**-0.5, mask, None, codec, codec, k_pages, v_pages, S)
    ours = ops_attention(call)
    assert ours.dtype == dtype
    exact = float_attention(
        queries, decoded(codec, k_pages, S), decoded(codec, v_pages, S), mask
    )
    sdpa = mx.fast.scaled_dot_product_attention(
        queries,
        decoded(codec, k_pages, S).astype(dtype),
        decoded(codec, v_pages, S).astype(dtype),
        scale=D**-0.5,
        mask=mask,
    )
    quantization = float_attention(queries, keys, values, mask)

    def error(out):
        out = out.astype(mx.float32)
        return (mx.linalg.norm(out - exact) / mx.linalg.norm(exact)).item()

    assert 0 < error(ours) <= 2 * error(sdpa)
    assert error(quantization) > 2 * error(ours)


# ---------------------------------------------------------------------------
# The driver


def test_attend_is_the_loop_where_no_kernel_applies():
    call, _, _ = make_call(CODECS["codebook-3,4"], n_q=4, L=3, length=70)
    call.mask = "causal"
    assert mx.array_equal(attend(call), ops_attention(call))


def test_attend_lands_an_incoming_token_before_the_loop():
    # a kernel's held buffer with its newest token not written yet: the loop
    # has the store write it first (``Call.land``)
    codec = Affine(8, 64)
    call, k, v = make_call((codec, codec), n_q=4, length=40)
    held = mx.zeros((2, 1, 2, 8, 64))
    token = mx.random.normal((2, 1, 2, 1, 64), key=mx.random.key(9))
    landed = []

    def land():
        landed.append(True)
        keys, values = (x.at[:, :, :1].add(t) for x, t in zip(held, token))
        return Recent(keys, values, 1)

    call.recent = Recent(held[0], held[1], 1, True, (token[0], token[1]))
    call.land = land
    out = attend(call)
    assert landed == [True]
    k = mx.concatenate([k, token[0]], axis=2)
    v = mx.concatenate([v, token[1]], axis=2)
    assert relative_error(out, float_attention(call.queries, k, v)) < 1e-4


@pytest.mark.parametrize("codecs", itertools.islice(CODECS.values(), 3))
def test_float16_pages_and_queries(codecs):
    # the output in the queries' dtype, scores in float32
    call, k, v = make_call(codecs, n_q=4, L=5, length=80, mask="causal")
    call.queries = call.queries.astype(mx.float16)
    out = ops_attention(call)
    assert out.dtype == mx.float16
    ref = float_attention(call.queries, k, v, "causal")
    assert relative_error(out, ref) < 2e-3
