"""The codebook KV cache: codebook, packing, attention against a float32
reference over the dequantized cache, save/load, batching and generation."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from kv_helpers import fill, relative_error
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.base import create_causal_mask, scaled_dot_product_attention
from mlx_lm.models.cache import (
    BatchKVCache,
    KVCache,
    load_prompt_cache,
    save_prompt_cache,
)
from tiny_llama import CONFIG, make_model

from omlx_cache import schemes
from omlx_cache.codebook import (
    Affine,
    BatchCodebookKVCache,
    Codebook,
    CodebookKVCache,
    Plain,
    codebook_scaled_dot_product_attention,
    codec,
    givens_rotate,
    lloyd_max,
    pack,
    rotate,
    unpack,
)

PAGE = 64
CODECS = {
    "3": (3, None),
    "3k-4v": (3, 4),
    "3k-affine4v": (3, Affine(4, 64)),
    "4-givens": (Codebook(4, "givens"), None),
    "3k-plain-v": (3, Plain()),
}


def reference(cache, queries, mask, sinks=None):
    keys, values = cache.dequantize()
    scale = queries.shape[-1] ** -0.5
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, sinks=sinks
    )


def attend(cache, queries, keys, values, mask, sinks=None):
    scale = queries.shape[-1] ** -0.5
    return scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
    )


# ---------------------------------------------------------------------------
# Codebook, packing, codecs


def test_lloyd_max_mse_of_a_unit_gaussian():
    levels, mse = lloyd_max(3)
    # 0.0346 and 0.0095 to three digits; 0.03455 and 0.009501 in Max (1960)
    assert mse == pytest.approx(0.0346, abs=1e-4)
    assert mse == pytest.approx(0.03455, abs=1e-5)
    assert lloyd_max(4)[1] == pytest.approx(0.0095, abs=1e-4)
    assert lloyd_max(4)[1] == pytest.approx(0.009501, abs=1e-6)
    assert np.allclose(levels, -np.array(levels[::-1]))
    # a sample agrees with the exact integral
    x = np.random.default_rng(0).standard_normal(400_000)
    levels = np.array(levels)
    nearest = levels[np.abs(x[:, None] - levels).argmin(axis=1)]
    assert abs(np.mean((x - nearest) ** 2) - mse) < 1e-3


@pytest.mark.parametrize("bits,dim", itertools.product([3, 4, 5], [64, 128, 256]))
def test_pack_round_trip_without_wasted_bits(bits, dim):
    mx.random.seed(bits * dim)
    indices = mx.random.randint(0, 1 << bits, (2, 3, 5, dim)).astype(mx.uint32)
    packed = pack(indices, bits)
    assert packed.dtype == mx.uint32
    assert packed.shape == (2, 3, 5, dim * bits // 32)
    assert mx.array_equal(unpack(packed, bits), indices)
    # every bit is used: all-ones indices pack into all-ones words
    ones = pack(mx.full((dim,), (1 << bits) - 1, mx.uint32), bits)
    assert (ones == 0xFFFFFFFF).all().item()


@pytest.mark.parametrize("bits,dim", [(3, 64), (3, 128), (4, 128)])
def test_bits_per_element(bits, dim):
    cache = CodebookKVCache(bits)
    fill(cache, 2, 10, 10, dim)
    assert cache.bits_per_element == (bits + 16 / dim,) * 2
    keys = cache.keys_and_values()[0]
    stored = sum(x.nbytes for x in keys) * 8 / (2 * 10 * dim)
    assert stored == bits + 16 / dim
    assert cache.nbytes == sum(x.nbytes for p in cache.key_pages for x in p) * 2


@pytest.mark.parametrize("rotation", ["hadamard", "givens", "none"])
def test_rotations_are_orthogonal(rotation):
    x = mx.random.normal((3, 128))
    y = rotate(x, rotation)
    assert mx.allclose(mx.linalg.norm(y, axis=-1), mx.linalg.norm(x, axis=-1))
    assert mx.allclose(rotate(y, rotation, inverse=True), x, atol=1e-5)
    if rotation == "givens":
        # planes of two coordinates: the other coordinates stay put
        e = mx.zeros((1, 8)).at[0, 2].add(1.0)
        assert (givens_rotate(e)[0, 4:] == 0).all().item()


@pytest.mark.parametrize("bits,norm", itertools.product([3, 4], ["dot", "length"]))
def test_reconstruction_error_near_lloyd_max(bits, norm):
    mx.random.seed(bits)
    x = mx.random.normal((1, 2, 512, 128)) * mx.random.uniform(0.1, 10, (512, 1))
    c = Codebook(bits, norm=norm)
    decoded = rotate(c.decode(c.encode(x), mx.float32), "hadamard", inverse=True)
    error = (((decoded - x) ** 2).sum(-1) / (x**2).sum(-1)).mean().item()
    assert error < 1.1 * lloyd_max(bits)[1]
    if norm == "length":
        lengths = mx.linalg.norm(decoded, axis=-1) / mx.linalg.norm(x, axis=-1)
        assert ((lengths - 1).abs() < 2e-3).all().item()


@pytest.mark.parametrize("bits,dim", itertools.product([3, 4, 5, 6], [64, 256]))
def test_dot_norm_keeps_scores_unbiased(bits, dim):
    # 5-bit keys lower Gemma's passkey log-probability against 4-bit ones
    # (a lab finding, in git: docs/quality-levers.md before its removal): not
    # from a biased codebook
    mx.random.seed(bits * dim)
    keys = mx.random.normal((4096, dim))
    query = mx.random.normal((dim,))
    c = Codebook(bits)
    decoded = rotate(c.decode(c.encode(keys), mx.float32), "hadamard", inverse=True)
    scores, errors = keys @ query, (decoded - keys) @ query
    slope = ((decoded @ query) * scores).sum() / (scores * scores).sum()
    assert abs(slope.item() - 1) < 0.01
    standard_error = mx.sqrt((errors * errors).mean() / errors.size)
    assert abs(errors.mean().item()) < 4 * standard_error.item()


def test_codec_specs_round_trip():
    for c in (Codebook(3), Codebook(4, "givens", "plain"), Affine(4, 32), Plain()):
        assert codec(c.spec) == c
    with pytest.raises(ValueError):
        codec("codebook-3-diagonal-dot")


# ---------------------------------------------------------------------------
# Attention against a float32 reference over the dequantized cache

SHAPES = list(itertools.product([1, 3, 4], [1, 65, 203]))


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("groups,length", SHAPES)
def test_decode_matches_reference(name, groups, length):
    mx.random.seed(length + groups)
    cache = CodebookKVCache(*CODECS[name], page_size=PAGE)
    keys, values = fill(cache, 2, length, 1, 64)
    queries = mx.random.normal((1, 2 * groups, 1, 64))
    out = attend(cache, queries, keys, values, None)
    assert out.shape == queries.shape
    assert relative_error(out, reference(cache, queries, None)) < 1e-4


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("groups,length", SHAPES[1::2])
def test_prefill_chunk_matches_reference(name, groups, length):
    mx.random.seed(length * groups)
    new = min(length, 37)
    cache = CodebookKVCache(*CODECS[name], page_size=PAGE)
    keys, values = fill(cache, 2, length, new, 128)
    queries = mx.random.normal((1, 2 * groups, new, 128))
    mask = "causal" if new > 1 else None
    out = attend(cache, queries, keys, values, mask)
    assert relative_error(out, reference(cache, queries, mask)) < 1e-4


@pytest.mark.parametrize("kind", ["bool", "additive", "per-head"])
def test_array_masks_with_batch(kind):
    mx.random.seed(7)
    batch, n_kv, groups, length, new = 3, 2, 4, 150, 20
    cache = CodebookKVCache(3, 4, page_size=PAGE)
    keys, values = fill(cache, n_kv, length, new, 64, batch=batch)
    queries = mx.random.normal((batch, n_kv * groups, new, 64))
    heads = n_kv * groups if kind == "per-head" else 1
    visible = mx.random.uniform(shape=(batch, heads, new, length)) > 0.5
    mask = create_causal_mask(new, length - new) & (visible | (mx.arange(length) == 0))
    if kind == "additive":
        mask = mx.where(mask, 0.0, -float("inf"))
    out = attend(cache, queries, keys, values, mask)
    assert relative_error(out, reference(cache, queries, mask)) < 1e-4


@pytest.mark.parametrize("tile", [8, 16, 40])
def test_tiles_within_pages(tile):
    mx.random.seed(tile)
    cache = CodebookKVCache(3, 4, page_size=PAGE)
    keys, values = fill(cache, 2, 150, 30, 64)
    queries = mx.random.normal((1, 6, 30, 64))
    out = codebook_scaled_dot_product_attention(
        queries,
        keys,
        values,
        cache.key_codec,
        cache.value_codec,
        scale=0.125,
        mask="causal",
        length=cache.offset,
        tile=tile,
    )
    assert relative_error(out, reference(cache, queries, "causal")) < 1e-4


def test_prefill_workspace_does_not_grow_with_context():
    def workspace(length):
        cache = CodebookKVCache(3, 4)
        keys, values = fill(cache, 2, length, 1, 64)
        queries = mx.random.normal((1, 8, 1024, 64))
        mx.eval(cache.key_pages, cache.value_pages, queries)
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        mx.eval(attend(cache, queries, keys, values, "causal"))
        return mx.get_peak_memory() - before

    # 2,048-key tiles: one tile against four
    assert workspace(8192) < 1.1 * workspace(2048)


def test_attention_sinks():
    mx.random.seed(11)
    cache = CodebookKVCache(3, page_size=PAGE)
    keys, values = fill(cache, 2, 100, 9, 64)
    queries = mx.random.normal((1, 6, 9, 64))
    sinks = mx.random.normal((6,)) * 3
    out = attend(cache, queries, keys, values, "causal", sinks)
    ref = reference(cache, queries, "causal", sinks)
    assert relative_error(out, ref) < 1e-4


def test_trim_then_write():
    mx.random.seed(3)
    cache = CodebookKVCache(3, page_size=PAGE)
    fill(cache, 1, 90, 90, 64)
    assert cache.is_trimmable() and cache.trim(40) == 40
    keys, values = fill(cache, 1, 30, 30, 64)
    assert (cache.size(), cache.capacity) == (80, 128)
    queries = mx.random.normal((1, 4, 30, 64))
    out = attend(cache, queries, keys, values, "causal")
    assert relative_error(out, reference(cache, queries, "causal")) < 1e-4


def test_quantization_error_is_small():
    # not a reference check: the codebook itself, against exact attention
    mx.random.seed(5)
    keys = mx.random.normal((1, 2, 300, 128))
    values = mx.random.normal((1, 2, 300, 128))
    queries = mx.random.normal((1, 8, 1, 128))
    exact = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=128**-0.5)
    errors = []
    for bits in (3, 4):
        cache = CodebookKVCache(bits)
        k, v = cache.update_and_fetch(keys, values)
        out = attend(cache, queries, k, v, None)
        errors.append(((out - exact) ** 2).sum() / (exact**2).sum())
    assert errors[1] < errors[0] < 0.1


# ---------------------------------------------------------------------------
# Saving, loading, state


def assert_same_storage(a, b):
    for x_parts, y_parts in zip(a.keys_and_values(), b.keys_and_values()):
        for x, y in zip(x_parts, y_parts):
            assert x.dtype == y.dtype and mx.array_equal(x, y)


@pytest.mark.parametrize("name", list(CODECS))
def test_save_and_load(tmp_path, name):
    mx.random.seed(1)
    cache = CodebookKVCache(*CODECS[name], page_size=PAGE)
    fill(cache, 2, 150, 1, 64)  # three pages
    batch = BatchCodebookKVCache.merge([cache, CodebookKVCache(*CODECS[name])])
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, [cache, batch, KVCache()], {"model": "tiny"})
    loaded, metadata = load_prompt_cache(path, return_metadata=True)
    assert metadata == {"model": "tiny"}
    assert [type(c) for c in loaded] == [CodebookKVCache, BatchCodebookKVCache, KVCache]
    for a, b in zip(loaded[:2], (cache, batch)):
        assert a._settings() == b._settings()
        assert a.nbytes == b.nbytes and a.size() == b.size()
        assert_same_storage(a, b)
    assert loaded[1].left_padding.tolist() == [0, 150]
    queries = mx.random.normal((1, 4, 1, 64))
    keys, values = loaded[0].update_and_fetch(*mx.random.normal((2, 1, 2, 1, 64)))
    out = attend(loaded[0], queries, keys, values, None)
    assert relative_error(out, reference(loaded[0], queries, None)) < 1e-4


def test_inconsistent_state_is_rejected():
    cache = CodebookKVCache(3)
    fill(cache, 2, 20, 20, 64)
    keys, values, offset, key_spec, value_spec, page_size, *center = cache.state
    assert center == ["", None, None]
    # states written before centering existed end at the page size
    old = CodebookKVCache.from_state(cache.state[:6])
    assert old.center == "" and old.offset == 20
    bad = [
        (keys, values, offset, "codebook-3-twirl-dot", value_spec, page_size),
        (keys, values, offset, Affine().spec, value_spec, page_size),
        (keys, values[:1], offset, key_spec, value_spec, page_size),
        (keys, values, 10_000, key_spec, value_spec, page_size),
    ]
    for state in bad:
        with pytest.raises(ValueError):
            CodebookKVCache.from_state(state)
        with pytest.raises(ValueError):
            cache.state = state
        # a rejected state leaves the cache as it was
        assert cache.key_codec == Codebook(3) and cache.offset == 20


# ---------------------------------------------------------------------------
# Batches


def singles(lengths, codecs=(3, 4), dim=64):
    caches = []
    for n in lengths:
        cache = CodebookKVCache(*codecs, page_size=PAGE)
        if n:
            fill(cache, 2, n, n, dim)
        caches.append(cache)
    return caches


def test_merge_and_extract_round_trip():
    mx.random.seed(2)
    caches = singles([5, 0, 70])
    batch = CodebookKVCache.merge(caches)
    assert isinstance(batch, BatchCodebookKVCache)
    assert batch.left_padding.tolist() == [65, 70, 0]
    assert batch.offset.tolist() == [5, 0, 70] and batch.size() == 70
    for i in (0, 2):
        single = batch.extract(i)
        assert isinstance(single, CodebookKVCache)
        assert single.offset == caches[i].offset
        assert_same_storage(single, caches[i])
    with pytest.raises(ValueError, match="different settings"):
        CodebookKVCache.merge([caches[0], CodebookKVCache(4)])


def test_batched_attention_matches_single():
    mx.random.seed(4)
    caches = singles([5, 37, 70])
    batch = CodebookKVCache.merge(caches)
    step = mx.random.normal((4, 3, 2, 1, 64))  # keys, values, queries x2 heads
    queries = mx.random.normal((3, 6, 1, 64))
    mask = batch.make_mask(1)
    keys, values = batch.update_and_fetch(step[0], step[1])
    out = attend(batch, queries, keys, values, mask)
    for i, cache in enumerate(caches):
        k, v = cache.update_and_fetch(step[0, i : i + 1], step[1, i : i + 1])
        single = attend(cache, queries[i : i + 1], k, v, None)
        assert relative_error(out[i : i + 1], single) < 1e-4


def test_filter_extend_track_single_caches():
    mx.random.seed(6)
    caches = singles([5, 37, 70])
    batch = CodebookKVCache.merge(caches)
    batch.filter([0, 1])  # drops 33 rows of shared padding
    assert batch.left_padding.tolist() == [32, 0] and batch.size() == 37
    other = CodebookKVCache.merge(singles([12, 100]))
    batch.extend(other)
    assert batch.left_padding.tolist() == [95, 63, 88, 0]
    assert batch.offset.tolist() == [5, 37, 12, 100] and batch.size() == 100
    kept = [caches[0], caches[1], *singles([])]
    for i, n in enumerate([5, 37]):
        assert_same_storage(batch.extract(i), kept[i])
    assert batch.extract(3).offset == 100
    # empty caches extend by offsets and padding only
    empty = BatchCodebookKVCache([1, 2], 3, 4)
    empty.extend(BatchCodebookKVCache([0], 3, 4))
    assert empty.empty() and empty.left_padding.tolist() == [1, 2, 0]


def rounded(codec_, x):
    """``x`` as ``codec_`` stores it, decoded and rotated back."""
    decoded = codec_.decode(codec_.encode(x), x.dtype)
    return rotate(decoded, codec_.rotation, inverse=True)


def test_batch_tracks_plain_batch_cache():
    # fed the same keys and values, rounded through the codecs, a BatchKVCache
    # attends as the codebook batch through prefill with right padding, decode,
    # filter and extend
    def step(caches, n, B):
        k, v = mx.random.normal((2, B, 2, n, 64))
        q = mx.random.normal((B, 4, n, 64))
        plain, coded = caches
        mask = plain.make_mask(n)
        assert mx.array_equal(mask, coded.make_mask(n))
        fk, fv = plain.update_and_fetch(
            rounded(coded.key_codec, k), rounded(coded.value_codec, v)
        )
        ck, cv = coded.update_and_fetch(k, v)
        out, cout = attend(plain, q, fk, fv, mask), attend(coded, q, ck, cv, mask)
        # queries that see no key (left padding) have no defined output
        seen = mask.any(axis=-1, keepdims=True)
        out, cout = mx.where(seen, out, 0), mx.where(seen, cout, 0)
        assert mx.allclose(out, cout, rtol=1e-4, atol=1e-4)
        assert mx.array_equal(plain.offset, coded.offset)
        assert plain._idx == coded._idx

    mx.random.seed(8)
    a = (BatchKVCache([2, 0, 5]), BatchCodebookKVCache([2, 0, 5], 3, 4, page_size=8))
    for c in a:
        c.prepare(right_padding=[1, 0, 3], lengths=[6, 9, 3])
    step(a, 9, 3)
    for c in a:
        c.finalize()
    for _ in range(12):
        step(a, 1, 3)
    for c in a:
        c.filter([1, 2])
    step(a, 1, 2)
    for c in a:
        c.filter([1])
    assert a[1].left_padding.tolist() == a[0].left_padding.tolist() == [0]
    step(a, 1, 1)
    b = (BatchKVCache([1, 0]), BatchCodebookKVCache([1, 0], 3, 4, page_size=8))
    step(b, 4, 2)
    for c, other in zip(a, b):
        c.extend(other)
    for _ in range(3):
        step(a, 1, 3)
    assert a[1].size() == a[0].size()


# ---------------------------------------------------------------------------
# A tiny model


@pytest.fixture(scope="module")
def model():
    return make_model()


def generated(model, prompt, cache, n=12):
    steps = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache)
    return [int(token) for token, _ in steps]


def test_generate_step_with_codebook_caches(model):
    prompt = list(range(3, 40))
    cache = [CodebookKVCache(3, 4) for _ in model.layers]
    tokens = generated(model, prompt, cache)
    assert len(tokens) == 12 and all(0 <= t < CONFIG["vocab_size"] for t in tokens)
    # generate_step feeds each token as it yields it
    assert cache[0].offset == len(prompt) + len(tokens)
    # and reserves the whole generation: one page of the prompt and max_tokens
    # (rounded up to 16 rows), so a decode step passes the kernel one page
    assert cache[0].reserve == len(prompt) + 12
    assert [p[0].shape[2] for p in cache[0].key_pages] == [64]
    # a lossless value codec and 4-bit keys stay close to the plain cache
    near = generated(model, prompt, [CodebookKVCache(4, Plain()) for _ in range(2)])
    exact = generated(model, prompt, [KVCache() for _ in range(2)])
    assert sum(a == b for a, b in zip(near, exact)) >= 6


def test_batch_generator_matches_single(model):
    prompts = [list(range(3, 30)), [5, 6, 7], list(range(40, 52))]
    gen = BatchGenerator(
        model, max_tokens=6, prefill_batch_size=2, completion_batch_size=3
    )
    caches = [[CodebookKVCache(3, 4) for _ in model.layers] for _ in prompts]
    uids = gen.insert(prompts, caches=caches)
    batch_tokens = {uid: [] for uid in uids}
    while responses := gen.next_generated():
        for r in responses:
            batch_tokens[r.uid].append(r.token)
    for uid, prompt in zip(uids, prompts):
        cache = [CodebookKVCache(3, 4) for _ in model.layers]
        assert batch_tokens[uid] == generated(model, prompt, cache, n=6)


def test_eval_schemes():
    for name, codecs in [
        ("codebook-3", (Codebook(3), Codebook(3))),
        ("codebook-3k-4v", (Codebook(3), Codebook(4))),
        ("codebook-3k-a4v", (Codebook(3), Affine(4, 64))),
        ("codebook-3-givens", (Codebook(3, "givens"),) * 2),
        ("codebook-16k-3v", (Plain(), Codebook(3))),
    ]:
        scheme = schemes.get_scheme(name)
        caches = scheme.make_cache(make_model())
        assert len(caches) == 2
        assert (caches[0].key_codec, caches[0].value_codec) == codecs
    assert schemes.get_scheme("codebook-3").bits_per_element == (3.125, 3.125)
