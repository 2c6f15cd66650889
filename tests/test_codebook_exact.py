"""Kept first tokens (``keep_exact``) in the codebook caches: attention over
[the first N tokens as they came ; the rest decoded], state, batches."""

import mlx.core as mx
import pytest
from kv_helpers import relative_error
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import (
    BatchKVCache,
    KVCache,
    load_prompt_cache,
    save_prompt_cache,
)

from omlx_cache import schemes
from omlx_cache.codebook import (
    Affine,
    BatchCodebookKVCache,
    Codebook,
    CodebookKVCache,
    decode_norm,
    encode_norm,
    rotate,
)

PAGE = 64
CODECS = {
    "3": (3, None),
    "4k-3v": (4, 3),
    "3k-affine4v": (3, Affine(4, 64)),
    "4k-3v-n8": (Codebook(4, norm_bits=8), Codebook(3, norm_bits=8)),
}


def attend(cache, queries, keys, values, mask, sinks=None):
    scale = queries.shape[-1] ** -0.5
    return scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
    )


def rounded(codec_, x):
    """``x`` as ``codec_`` stores it, decoded and rotated back."""
    decoded = codec_.decode(codec_.encode(x), x.dtype)
    return rotate(decoded, codec_.rotation, inverse=True)


def kept_reference(cache, keys, values, n):
    """What a cache keeping its first ``n`` tokens must attend: the same
    cache without them, decoded, with its first ``n`` rows as they came."""
    k, v = cache.dequantize()
    return (
        mx.concatenate([keys[..., :n, :], k[..., n:, :]], axis=2),
        mx.concatenate([values[..., :n, :], v[..., n:, :]], axis=2),
    )


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("center", ["", "k", "kv"])
@pytest.mark.parametrize("n,lengths", [(4, (50, 1)), (16, (9, 30, 1)), (1, (70,))])
def test_attention_reads_kept_tokens(name, center, n, lengths):
    mx.random.seed(n + len(lengths))
    total = sum(lengths)
    keys, values = mx.random.normal((2, 1, 2, total, 64)) * 2 + 0.5
    kept = CodebookKVCache(*CODECS[name], page_size=PAGE, center=center, keep_exact=n)
    plain = CodebookKVCache(*CODECS[name], page_size=PAGE, center=center)
    start = 0
    for length in lengths:
        part = (x[..., start : start + length, :] for x in (keys, values))
        k, v = part
        fetched = kept.update_and_fetch(k, v)
        plain.update_and_fetch(k, v)
        start += length
        queries = mx.random.normal((1, 6, length, 64))
        mask = "causal" if length > 1 else None
        out = attend(kept, queries, *fetched, mask)
        ref_k, ref_v = kept_reference(
            plain, keys[..., :start, :], values[..., :start, :], n
        )
        ref = mx.fast.scaled_dot_product_attention(
            queries, ref_k, ref_v, scale=64**-0.5, mask=mask
        )
        assert relative_error(out, ref) < 1e-4
    assert kept.exact_keys.shape[2] == min(n, total)
    # dequantize gives what attention reads
    dk, dv = kept.dequantize()
    ref_k, ref_v = kept_reference(plain, keys, values, n)
    assert mx.allclose(dk, ref_k, atol=1e-4) and mx.allclose(dv, ref_v, atol=1e-4)


def test_kept_tokens_lower_the_error():
    mx.random.seed(0)
    keys, values = mx.random.normal((2, 1, 2, 40, 64))
    keys = keys.at[..., 0, :].multiply(20)  # an outlier first key, as sinks are
    queries = mx.random.normal((1, 4, 1, 64))
    exact = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125)
    errors = []
    for n in (0, 1):
        cache = CodebookKVCache(3, keep_exact=n)
        k, v = cache.update_and_fetch(keys, values)
        errors.append(relative_error(attend(cache, queries, k, v, None), exact))
    assert errors[1] < errors[0]


def test_trim_below_kept_tokens_then_write():
    mx.random.seed(3)
    keys, values = mx.random.normal((2, 1, 1, 30, 64))
    cache = CodebookKVCache(3, page_size=PAGE, keep_exact=8)
    cache.update_and_fetch(keys[..., :20, :], values[..., :20, :])
    assert cache.trim(15) == 15 and cache.offset == 5
    k, v = cache.update_and_fetch(keys[..., 20:, :], values[..., 20:, :])
    new_keys = mx.concatenate([keys[..., :5, :], keys[..., 20:, :]], axis=2)
    new_values = mx.concatenate([values[..., :5, :], values[..., 20:, :]], axis=2)
    assert mx.array_equal(cache.exact_keys, rotate(new_keys[..., :8, :], "hadamard"))
    plain = CodebookKVCache(3, page_size=PAGE)
    plain.update_and_fetch(new_keys, new_values)
    queries = mx.random.normal((1, 2, 1, 64))
    ref = mx.fast.scaled_dot_product_attention(
        queries, *kept_reference(plain, new_keys, new_values, 8), scale=0.125
    )
    assert relative_error(attend(cache, queries, k, v, None), ref) < 1e-4


def test_norm8_codes():
    x = mx.array([1e-3, 0.37, 1.0, 5.5, 123.4, 9000.0])
    back = decode_norm(encode_norm(x))
    assert ((back / x - 1).abs() < 0.033).all().item()
    c = Codebook(3, norm_bits=8)
    assert c.bits_per_element(64) == 3.125 and c.spec == "codebook-3-hadamard-dot-n8"
    page = c.encode(mx.random.normal((1, 2, 5, 64)))
    assert page[1].dtype == mx.uint8


# ---------------------------------------------------------------------------
# State


def test_state_round_trip(tmp_path):
    mx.random.seed(1)
    cache = CodebookKVCache(4, 3, page_size=PAGE, center="k", keep_exact=4)
    keys, values = mx.random.normal((2, 1, 2, 150, 64))
    cache.update_and_fetch(keys, values)  # three pages
    batch = BatchCodebookKVCache.merge(
        [cache, CodebookKVCache(4, 3, center="k", keep_exact=4)]
    )
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, [cache, batch, KVCache()])
    loaded = load_prompt_cache(path)
    for a, b in zip(loaded[:2], (cache, batch)):
        assert a._settings() == b._settings() and a.keep_exact == 4
        assert mx.array_equal(a.exact_keys, b.exact_keys)
        assert mx.array_equal(a.exact_values, b.exact_values)
        assert a.nbytes == b.nbytes
    queries = mx.random.normal((1, 4, 1, 64))
    step = mx.random.normal((2, 1, 2, 1, 64))
    outs = []
    for c in (cache, loaded[0]):
        k, v = c.update_and_fetch(*step)
        outs.append(attend(c, queries, k, v, None))
    assert mx.array_equal(*outs)
    # a state without kept tokens is as before they existed
    assert len(CodebookKVCache(3).state) == 9 and len(cache.state) == 12
    with pytest.raises(ValueError, match="kept keys"):
        CodebookKVCache.from_state((*cache.state[:10], cache.exact_keys, None))


# ---------------------------------------------------------------------------
# Batches


def singles(lengths, n=4):
    caches = []
    for length in lengths:
        cache = CodebookKVCache(4, 3, page_size=PAGE, center="k", keep_exact=n)
        if length:
            cache.update_and_fetch(*mx.random.normal((2, 1, 2, length, 64)))
        caches.append(cache)
    return caches


def test_merge_extract_and_attend():
    mx.random.seed(2)
    caches = singles([3, 0, 70])
    batch = CodebookKVCache.merge(caches)
    assert isinstance(batch, BatchCodebookKVCache) and batch.keep_exact == 4
    assert batch.left_padding.tolist() == [67, 70, 0]
    for i in (0, 2):
        single = batch.extract(i)
        assert single.offset == caches[i].offset and single.keep_exact == 4
        assert mx.array_equal(single.exact_keys, caches[i].exact_keys)
        assert mx.array_equal(single.exact_values, caches[i].exact_values)
        for x, y in zip(single.keys_and_values(), caches[i].keys_and_values()):
            assert all(mx.array_equal(a, b) for a, b in zip(x, y))
    step = mx.random.normal((2, 3, 2, 1, 64))
    queries = mx.random.normal((3, 6, 1, 64))
    mask = batch.make_mask(1)
    keys, values = batch.update_and_fetch(*step)
    out = attend(batch, queries, keys, values, mask)
    for i, cache in enumerate(caches):
        k, v = cache.update_and_fetch(step[0, i : i + 1], step[1, i : i + 1])
        single = attend(cache, queries[i : i + 1], k, v, None)
        assert relative_error(out[i : i + 1], single) < 1e-4
    with pytest.raises(ValueError, match="different settings"):
        CodebookKVCache.merge([caches[0], CodebookKVCache(4, 3, center="k")])


def test_batch_tracks_plain_batch_cache():
    # a BatchKVCache fed each sequence's first N tokens as they came and the
    # rest rounded through the codecs attends as the codebook batch through
    # prefill with right padding, decode, filter and extend
    n = 3

    def step(caches, t, B):
        k, v = mx.random.normal((2, B, 2, t, 64))
        q = mx.random.normal((B, 4, t, 64))
        plain, coded = caches
        mask = plain.make_mask(t)
        token = coded._idx + mx.arange(t)[None] - coded.left_padding[:, None]
        first = ((token >= 0) & (token < n))[:, None, :, None]
        fk = mx.where(first, k, rounded(coded.key_codec, k))
        fv = mx.where(first, v, rounded(coded.value_codec, v))
        fk, fv = plain.update_and_fetch(fk, fv)
        ck, cv = coded.update_and_fetch(k, v)
        out, cout = attend(plain, q, fk, fv, mask), attend(coded, q, ck, cv, mask)
        seen = mask.any(axis=-1, keepdims=True)
        out, cout = mx.where(seen, out, 0), mx.where(seen, cout, 0)
        assert mx.allclose(out, cout, rtol=1e-4, atol=1e-4)

    def pair(padding):
        return (
            BatchKVCache(padding),
            BatchCodebookKVCache(padding, 3, 4, page_size=8, keep_exact=n),
        )

    mx.random.seed(8)
    a = pair([2, 0, 5])
    for c in a:
        c.prepare(right_padding=[1, 0, 3], lengths=[6, 9, 3])
    step(a, 9, 3)
    for c in a:
        c.finalize()
    for _ in range(4):
        step(a, 1, 3)
    for c in a:
        c.filter([1, 2])
    step(a, 1, 2)
    b = pair([1, 0])
    step(b, 2, 2)  # the first sequence's kept tokens are not all written yet
    step(b, 2, 2)
    for c, other in zip(a, b):
        c.extend(other)
    for _ in range(3):
        step(a, 1, 4)
    single = a[1].extract(2)
    assert single.exact_keys.shape[2] == n


def test_eval_scheme_names():
    scheme = schemes.get_scheme("codebook-4k-3v+center+exact16")
    assert scheme.kept_tokens == 16
    cache = scheme.make_cache(_TinyModel())[0]
    assert cache.keep_exact == 16 and cache.center == "k"
    scheme = schemes.get_scheme("codebook-3+center+exact4+k4@1")
    caches = scheme.make_cache(_TinyModel())
    assert [c.key_codec.bits for c in caches] == [3, 4]
    assert [c.value_codec.bits for c in caches] == [3, 3]
    mixed = schemes.get_scheme("codebook-3+center+exact4+k4@1+v4@0")
    assert mixed.high_layers == (0, 1)
    assert [
        (c.key_codec.bits, c.value_codec.bits) for c in mixed.make_cache(_TinyModel())
    ] == [(3, 4), (4, 3)]
    n8 = schemes.get_scheme("codebook-4k-3v-n8+center+exact16").make_cache(_TinyModel())
    assert n8[0].key_codec == Codebook(4, norm_bits=8)
    # bits per element at 4,096 tokens: codes, norms, kept tokens
    for c, bits in zip(caches, (3, 4)):
        c.update_and_fetch(*mx.random.normal((2, 1, 2, 20, 64)))
    k, v = schemes.average_bits(caches, 4096)
    kept, mean = 4 * 16 / 4096, 32 / 4096  # and the float32 key means
    assert k == pytest.approx((3.25 + 4.25) / 2 + kept + mean)
    assert v == pytest.approx(3.25 + kept)
    for suffix, mode in (("+qscale", "qk"), ("+qscale-q", "q")):
        scheme = schemes.get_scheme(f"codebook-3{suffix}+exact4")
        assert scheme.make_cache(_TinyModel())[0].key_scale == mode
    with pytest.raises(ValueError, match="key_scale"):
        CodebookKVCache(3, key_scale="k")


# ---------------------------------------------------------------------------
# Keys weighed by the queries (key_scale)


def reference(cache, queries, mask):
    keys, values = cache.dequantize()
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=queries.shape[-1] ** -0.5, mask=mask
    )


@pytest.mark.parametrize("mode", ["qk", "q"])
@pytest.mark.parametrize("center,n", [("", 0), ("k", 4), ("kv", 16)])
def test_key_scale_attends_as_its_dequantized_cache(center, n, mode):
    mx.random.seed(9)
    keys, values = mx.random.normal((2, 1, 2, 60, 64))
    keys = keys * mx.linspace(0.2, 3, 64)  # channels of different sizes
    cache = CodebookKVCache(
        3, 4, page_size=PAGE, center=center, keep_exact=n, key_scale=mode
    )
    queries = mx.random.normal((1, 6, 50, 64)) * mx.linspace(3, 0.2, 64)
    k, v = cache.update_and_fetch(keys[..., :50, :], values[..., :50, :])
    assert cache._pending is not None and not cache.empty()
    out = attend(cache, queries, k, v, "causal")
    weights = cache.key_weights
    assert weights.shape == (1, 2, 1, 64) and cache._pending is None
    # the first channels weigh more: large queries, small keys
    assert (weights[..., :8].mean() > 2 * weights[..., -8:].mean()).item()
    assert relative_error(out, reference(cache, queries, "causal")) < 1e-4
    k, v = cache.update_and_fetch(keys[..., 50:, :], values[..., 50:, :])
    queries = queries[:, :, :10]
    out = attend(cache, queries, k, v, "causal")
    assert relative_error(out, reference(cache, queries, "causal")) < 1e-4
    if n:
        assert mx.allclose(
            cache.dequantize()[0][..., :n, :], keys[..., :n, :], atol=1e-4
        )


@pytest.mark.parametrize("mode", ["qk", "q"])
def test_key_scale_lowers_the_score_error(mode):
    mx.random.seed(10)
    keys = mx.random.normal((1, 1, 200, 64)) * mx.linspace(0.2, 3, 64)
    values = mx.random.normal((1, 1, 200, 64))
    queries = mx.random.normal((1, 1, 200, 64)) * mx.linspace(3, 0.2, 64)
    errors = []
    for scale in ("", mode):
        cache = CodebookKVCache(3, center="k", key_scale=scale)
        k, v = cache.update_and_fetch(keys, values)
        attend(cache, queries, k, v, "causal")
        scores = queries @ (cache.dequantize()[0] - keys).swapaxes(-1, -2)
        errors.append((scores**2).mean().item())
    assert errors[1] < 0.8 * errors[0]


def test_key_scale_state_and_batches(tmp_path):
    mx.random.seed(12)
    caches = []
    for length in (7, 30):
        cache = CodebookKVCache(4, 3, center="k", keep_exact=4, key_scale=True)
        k, v = cache.update_and_fetch(*mx.random.normal((2, 1, 2, length, 64)))
        attend(cache, mx.random.normal((1, 6, length, 64)), k, v, "causal")
        caches.append(cache)
    unread = CodebookKVCache(4, 3, center="k", keep_exact=4, key_scale=True)
    unread.update_and_fetch(*mx.random.normal((2, 1, 2, 5, 64)))
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, [caches[0], unread])  # a held write is encoded (weights 1)
    loaded = load_prompt_cache(path)
    assert mx.array_equal(loaded[0].key_weights, caches[0].key_weights)
    assert (loaded[1].key_weights == 1).all().item() and loaded[1].offset == 5
    batch = CodebookKVCache.merge([*caches, unread])
    assert batch.key_weights.shape == (3, 2, 1, 64)
    single = batch.extract(1)
    assert mx.array_equal(single.key_weights, caches[1].key_weights)
    step = mx.random.normal((2, 3, 2, 1, 64))
    queries = mx.random.normal((3, 6, 1, 64))
    mask = batch.make_mask(1)
    out = attend(batch, queries, *batch.update_and_fetch(*step), mask)
    for i, cache in enumerate([*caches, unread]):
        k, v = cache.update_and_fetch(step[0, i : i + 1], step[1, i : i + 1])
        assert (
            relative_error(
                out[i : i + 1], attend(cache, queries[i : i + 1], k, v, None)
            )
            < 1e-4
        )
    batch.filter([0, 2])
    assert batch.key_weights.shape[0] == 2


def test_key_scale_batch_first_write_with_padding():
    # a batch weighs each sequence's keys by its own queries, padding left out
    mx.random.seed(13)
    batch = BatchCodebookKVCache([3, 0], 3, center="k", key_scale=True)
    keys, values = mx.random.normal((2, 2, 2, 12, 64))
    queries = mx.random.normal((2, 4, 12, 64))
    mask = batch.make_mask(12)
    out = attend(batch, queries, *batch.update_and_fetch(keys, values), mask)
    singles = []
    for i, pad in enumerate((3, 0)):
        single = CodebookKVCache(3, center="k", key_scale=True)
        k, v = single.update_and_fetch(
            keys[i : i + 1, :, pad:], values[i : i + 1, :, pad:]
        )
        singles.append(attend(single, queries[i : i + 1, :, pad:], k, v, "causal"))
        assert mx.allclose(batch.key_weights[i], single.key_weights, rtol=1e-4).item()
    assert relative_error(out[1:], singles[1]) < 1e-4
    assert relative_error(out[:1, :, 3:], singles[0]) < 1e-4


def test_key_scale_batch_state_encodes_a_held_first_write():
    # a batch's state is read before any attention call: its pages must hold
    # the first write (weights of ones), as a single cache's do
    mx.random.seed(14)
    keys, values = mx.random.normal((2, 2, 2, 12, 64))
    held = BatchCodebookKVCache([3, 0], 3, center="k", key_scale=True)
    held.update_and_fetch(keys, values)
    state = held.state
    assert held._pending is None and (held.key_weights == 1).all().item()
    plain = BatchCodebookKVCache([3, 0], 3, center="k")
    plain.update_and_fetch(keys, values)
    for a, b in zip(state[:2], plain.state[:2]):
        assert all(mx.array_equal(x, y) for x, y in zip(a, b))


class _TinyModel:
    """Two layers of plain caches, as ``plain_layers`` needs."""

    layers = (None, None)

    def make_cache(self):
        return [KVCache(), KVCache()]


# ---------------------------------------------------------------------------
# Generation


def test_generation_with_kept_tokens_and_weighted_keys():
    from mlx_lm.generate import BatchGenerator, generate_step
    from tiny_llama import make_model

    model = make_model()

    def caches():
        return [
            CodebookKVCache(4, 3, center="k", keep_exact=4, key_scale="q")
            for _ in model.layers
        ]

    def generated(prompt, n=6):
        steps = generate_step(
            mx.array(prompt), model, max_tokens=n, prompt_cache=caches()
        )
        return [int(token) for token, _ in steps]

    prompts = [list(range(3, 30)), [5, 6, 7], list(range(40, 52))]
    gen = BatchGenerator(
        model, max_tokens=6, prefill_batch_size=2, completion_batch_size=3
    )
    uids = gen.insert(prompts, caches=[caches() for _ in prompts])
    tokens = {uid: [] for uid in uids}
    while responses := gen.next_generated():
        for r in responses:
            tokens[r.uid].append(r.token)
    for uid, prompt in zip(uids, prompts):
        assert tokens[uid] == generated(prompt)
