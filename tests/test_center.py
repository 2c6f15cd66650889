"""Centered caches (omlx_cache.center): keys (and values) stored minus a
per-head mean frozen at the first write leave attention unchanged."""

import mlx.core as mx
import pytest
from kv_helpers import fill, relative_error
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models import gemma3_text
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    kv_rotate,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)
from tiny_llama import make_model

from omlx_cache import schemes
from omlx_cache.center import (
    CenteredBatchQuantizedKVCache,
    CenteredQuantizedKVCache,
    CenteredQuantizedRotatingKVCache,
    centered,
    check_center,
    first_write_mean,
)
from omlx_cache.codebook import BatchCodebookKVCache, CodebookKVCache, Plain


def attend(cache, queries, keys, values, mask, sinks=None):
    scale = queries.shape[-1] ** -0.5
    return scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
    )


def dequantized(cache):
    """What an affine cache holds, rotated back, with its means added back."""
    keys, values = cache.keys_and_values()
    out = []
    for x, group_size, bits, rotated, mean in (
        (keys, cache.key_group_size, cache.key_bits, cache.rotate_keys, cache.key_mean),
        (
            values,
            cache.value_group_size,
            cache.value_bits,
            cache.rotate_values,
            cache.value_mean,
        ),
    ):
        x = mx.dequantize(*x, group_size=group_size, bits=bits)
        x = kv_rotate(x, inverse=True) if rotated else x
        out.append(x if mean is None else x + mean)
    return out


def float_reference(keys, values, queries, mask, sinks=None):
    scale = queries.shape[-1] ** -0.5
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, sinks=sinks
    )


def offset_kv(shape, seed):
    """Random keys and values with a large common part, as real keys have."""
    mx.random.seed(seed)
    common = 4 * mx.random.normal((shape[0], shape[1], 1, shape[3]))
    return common + mx.random.normal(shape), common + mx.random.normal(shape)


# ---------------------------------------------------------------------------
# Attention unchanged


@pytest.mark.parametrize("center", ["k", "kv"])
@pytest.mark.parametrize("batch,groups", [(1, 1), (2, 3)])
def test_unquantized_centered_cache_attends_as_float(center, batch, groups):
    # codebook caches with lossless codecs: only the centering differs
    keys, values = offset_kv((batch, 2, 90, 64), seed=groups)
    cache = CodebookKVCache(Plain(), Plain(), page_size=64, center=center)
    for start, stop in ((0, 40), (40, 41), (41, 90)):  # prefill, decode, chunk
        k, v = cache.update_and_fetch(keys[:, :, start:stop], values[:, :, start:stop])
        queries = mx.random.normal((batch, 2 * groups, stop - start, 64))
        mask = "causal" if stop - start > 1 else None
        out = attend(cache, queries, k, v, mask)
        ref = float_reference(keys[:, :, :stop], values[:, :, :stop], queries, mask)
        assert relative_error(out, ref) < 1e-5
    assert (cache.value_mean is not None) == (center == "kv")


@pytest.mark.parametrize("center", ["k", "kv"])
@pytest.mark.parametrize("rotate", [False, True])
def test_affine_centered_cache_attends_over_what_it_holds(center, rotate):
    # the quantized attention equals float attention over the dequantized,
    # un-centered cache: the mean's shift of the scores cancels exactly
    keys, values = offset_kv((2, 2, 150, 64), seed=3)
    cache = CenteredQuantizedKVCache(64, (8, 4), rotate=rotate, center=center)
    cache.page_size = 64
    cache.update_and_fetch(keys[:, :, :120], values[:, :, :120])
    k, v = cache.update_and_fetch(keys[:, :, 120:], values[:, :, 120:])
    queries = mx.random.normal((2, 6, 30, 64))
    out = attend(cache, queries, k, v, "causal")
    ref = float_reference(*dequantized(cache), queries, "causal")
    assert relative_error(out, ref) < 1e-4


def test_centering_cuts_quantization_error_of_offset_keys():
    keys, values = offset_kv((1, 2, 200, 64), seed=5)
    queries = mx.random.normal((1, 4, 1, 64))
    exact = float_reference(keys, values, queries, None)
    errors = {}
    for name, cache in [
        ("plain", QuantizedKVCache(64, 4)),
        ("k", CenteredQuantizedKVCache(64, 4)),
        ("kv", CenteredQuantizedKVCache(64, 4, center="kv")),
    ]:
        k, v = cache.update_and_fetch(keys, values)
        out = attend(cache, queries, k, v, None)
        errors[name] = ((out - exact) ** 2).sum().item()
    assert errors["kv"] < errors["k"] < errors["plain"]


def test_model_logits_unchanged_through_chunks():
    model = make_model()
    tokens = mx.random.randint(0, 320, (2, 70), key=mx.random.key(1))

    def run(caches):
        chunks = (tokens[:, :32], tokens[:, 32:33], tokens[:, 33:])
        return mx.concatenate([model(c, cache=caches) for c in chunks], axis=1)

    ref = run([KVCache() for _ in range(2)])
    for center in ("k", "kv"):
        caches = [CodebookKVCache(Plain(), Plain(), center=center) for _ in range(2)]
        assert relative_error(run(caches), ref) < 1e-5


def test_sinks_with_centered_keys():
    keys, values = offset_kv((1, 2, 100, 64), seed=11)
    cache = CodebookKVCache(Plain(), Plain(), center="k")
    k, v = cache.update_and_fetch(keys, values)
    queries = mx.random.normal((1, 6, 9, 64))
    sinks = mx.random.normal((6,)) * 3
    mask = mx.ones((9, 100), mx.bool_)
    out = attend(cache, queries, k, v, mask, sinks)
    ref = float_reference(keys, values, queries, mask, sinks)
    assert relative_error(out, ref) < 1e-5
    cache = CodebookKVCache(Plain(), Plain(), center="kv")
    k, v = cache.update_and_fetch(keys, values)
    with pytest.raises(ValueError, match="sinks"):
        attend(cache, queries, k, v, mask, sinks)


# ---------------------------------------------------------------------------
# The mean


def test_mean_of_first_write_then_frozen():
    keys, values = offset_kv((2, 2, 40, 64), seed=2)
    cache = CenteredQuantizedKVCache(64, 4, center="kv")
    cache.update_and_fetch(keys[:, :, :30], values[:, :, :30])
    # the first token is left out
    expected = keys[:, :, 1:30].mean(axis=2, keepdims=True)
    assert mx.allclose(cache.key_mean, expected, atol=1e-5)
    assert cache.key_mean.shape == (2, 2, 1, 64)
    assert mx.allclose(cache.value_mean, values[:, :, 1:30].mean(2, keepdims=True))
    frozen = mx.array(cache.key_mean)
    cache.update_and_fetch(keys[:, :, 30:] + 100, values[:, :, 30:])
    cache.trim(40)
    cache.update_and_fetch(keys, values)
    assert mx.array_equal(cache.key_mean, frozen)


def test_mean_of_a_single_token_and_of_padded_rows():
    x = mx.arange(2 * 5 * 3, dtype=mx.float32).reshape(2, 1, 5, 3)
    assert mx.array_equal(first_write_mean(x[:, :, :1]), x[:, :, :1])
    # element 0: rows 2..4, the first (row 2) left out; element 1: row 4 only
    mean = first_write_mean(x, start=mx.array([2, 4]))
    assert mx.allclose(mean[0, 0, 0], x[0, 0, 3:].mean(axis=0))
    assert mx.array_equal(mean[1, 0, 0], x[1, 0, 4])
    # no row in range: zero, no centering
    mean = first_write_mean(x, start=mx.array([0, 5]), stop=mx.array([3, 5]))
    assert mx.allclose(mean[0, 0, 0], x[0, 0, 1:3].mean(axis=0))
    assert not mean[1].any()


def test_rotating_cache_centers_its_window():
    keys, values = offset_kv((1, 2, 60, 64), seed=4)
    cache = CenteredQuantizedRotatingKVCache(16, keep=2, group_size=64, bits=8)
    cache.update_and_fetch(keys[:, :, :20], values[:, :, :20])
    mean = mx.array(cache.key_mean)
    for t in range(20, 60):
        k, v = cache.update_and_fetch(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    assert mx.array_equal(cache.key_mean, mean) and cache.offset == 60
    with pytest.raises(NotImplementedError, match="batched"):
        CenteredQuantizedRotatingKVCache.merge([cache])
    queries = mx.random.normal((1, 4, 1, 64))
    out = attend(cache, queries, k, v, None)
    k = mx.dequantize(*k, group_size=64, bits=8) + mean
    v = mx.dequantize(*v, group_size=64, bits=8)
    assert relative_error(out, float_reference(k, v, queries, None)) < 1e-4


# ---------------------------------------------------------------------------
# State, save and load


def test_save_and_load(tmp_path):
    keys, values = offset_kv((1, 2, 50, 64), seed=6)
    caches = [
        CenteredQuantizedKVCache(64, (8, 4), rotate=True, center="kv"),
        CenteredQuantizedRotatingKVCache(32, 4, 64, 4, center="k"),
        CodebookKVCache(3, 4, center="kv"),
        CenteredQuantizedKVCache(32, 4),  # empty: no mean yet
    ]
    for c in caches[:3]:
        c.update_and_fetch(keys[:, :, :40], values[:, :, :40])
    caches.append(
        CodebookKVCache.merge([caches[2], CodebookKVCache(3, 4, center="kv")])
    )
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    assert loaded[3].key_mean is None and loaded[3].center == "k"
    assert loaded[4].center == "kv" and not loaded[4].key_mean[1].any()
    queries = mx.random.normal((1, 4, 10, 64))
    for a, b in zip(loaded[:3], caches[:3]):
        assert a.center == b.center and a.nbytes == b.nbytes
        assert mx.array_equal(a.key_mean, b.key_mean)
        # later writes are centered alike
        outs = [
            attend(
                c,
                queries,
                *c.update_and_fetch(keys[:, :, 40:], values[:, :, 40:]),
                "causal",
            )
            for c in (a, b)
        ]
        assert mx.array_equal(*outs)


def test_bad_settings_and_states_are_rejected():
    for bad in ("q", "kvv", 1):
        with pytest.raises(ValueError, match="center"):
            check_center(bad)
    assert (check_center(None), check_center(True), check_center("kv")) == (
        "",
        "k",
        "kv",
    )
    with pytest.raises(ValueError, match="needs center"):
        CenteredQuantizedKVCache(64, 4, center="")
    with pytest.raises(ValueError, match="center"):
        CodebookKVCache(3, center="v")
    for name in (
        "4+centre",
        "4+center+rotate",
        "4+center-v",
        "codebook-3+center-k",
        "4/g48",
    ):
        with pytest.raises(ValueError):
            schemes.get_scheme(name)
    cache = CodebookKVCache(3, center="k")
    fill(cache, 2, 20, 20, 64)
    *head, _, key_mean, _ = cache.state
    for state in (
        (*head, "kv", key_mean, None),  # kv without a value mean
        (*head, "", key_mean, None),  # a mean with centering off
        (*head, "k", key_mean[:, :1], None),  # a mean for one head of two
    ):
        with pytest.raises(ValueError):
            cache.state = state
        assert cache.center == "k" and cache.key_mean is key_mean
    affine = CenteredQuantizedKVCache(64, 4)
    fill(affine, 2, 20, 20, 64)
    with pytest.raises(ValueError):
        CenteredQuantizedKVCache.from_state((*affine.state[:-1], affine.key_mean))
    with pytest.raises(ValueError, match="empty"):
        centered(affine)


# ---------------------------------------------------------------------------
# Batches


@pytest.mark.parametrize("kind", ["affine", "codebook"])
def test_batch_means_per_sequence(kind):
    # a left-padded batch gets each sequence's own means, padding left out;
    # merge, filter, extend and extract carry them
    def single():
        if kind == "affine":
            return CenteredQuantizedKVCache(64, 8, center="kv")
        return CodebookKVCache(4, center="kv")

    lengths = [7, 30, 19]
    kv = [offset_kv((1, 2, n, 64), seed=n) for n in lengths]
    singles = [single() for _ in lengths]
    for c, (k, v) in zip(singles, kv):
        c.update_and_fetch(k, v)
    padding = [30 - n for n in lengths]
    if kind == "affine":
        batch = CenteredBatchQuantizedKVCache(padding, 64, 8, center="kv")
    else:
        batch = BatchCodebookKVCache(padding, 4, center="kv")
    pad = [
        mx.pad(k, [(0, 0), (0, 0), (p, 0), (0, 0)]) for (k, _), p in zip(kv, padding)
    ]
    vpad = [
        mx.pad(v, [(0, 0), (0, 0), (p, 0), (0, 0)]) for (_, v), p in zip(kv, padding)
    ]
    batch.update_and_fetch(mx.concatenate(pad), mx.concatenate(vpad))
    merged = type(singles[0]).merge(singles)
    assert type(merged) is type(batch)
    for b in (batch, merged):
        for i, c in enumerate(singles):
            assert mx.allclose(b.key_mean[i], c.key_mean[0], atol=1e-5)
            assert mx.allclose(b.value_mean[i], c.value_mean[0], atol=1e-5)
            assert mx.array_equal(b.extract(i).key_mean, b.key_mean[i : i + 1])
    batch.filter([2, 0])
    assert mx.array_equal(batch.key_mean, merged.key_mean[mx.array([2, 0])])
    empty = type(batch)([0], 64, 8, center="kv") if kind == "affine" else None
    if empty is None:
        empty = BatchCodebookKVCache([0], 4, center="kv")
    batch.extend(empty)
    assert batch.key_mean.shape[0] == 3 and not batch.key_mean[2].any()
    with pytest.raises(ValueError):
        batch.extend(
            type(empty)(
                [0], **({"center": "k"} | ({"keys": 4} if kind == "codebook" else {}))
            )
        )


def test_right_padded_prompt_leaves_padding_out_of_the_mean():
    keys, values = offset_kv((2, 2, 12, 64), seed=9)
    batch = BatchCodebookKVCache([0, 0], 4, center="k")
    batch.prepare(lengths=[12, 5], right_padding=[0, 7])
    batch.update_and_fetch(keys, values)
    expected = keys[1, :, 1:5].mean(axis=1, keepdims=True)
    assert mx.allclose(batch.key_mean[1], expected, atol=1e-5)


# ---------------------------------------------------------------------------
# Generation and schemes


@pytest.fixture(scope="module")
def model():
    return make_model()


def generated(model, prompt, cache, n=6):
    steps = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache)
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("kind", ["affine", "codebook"])
def test_batch_generator_matches_single(model, kind):
    prompts = [list(range(3, 30)), [5, 6, 7], list(range(40, 52))]
    gen = BatchGenerator(
        model, max_tokens=6, prefill_batch_size=2, completion_batch_size=3
    )

    def caches():
        if kind == "affine":
            return [CenteredQuantizedKVCache(64, 8, center="kv") for _ in model.layers]
        return [CodebookKVCache(Plain(), Plain(), center="kv") for _ in model.layers]

    uids = gen.insert(prompts, caches=[caches() for _ in prompts])
    batch_tokens = {uid: [] for uid in uids}
    while responses := gen.next_generated():
        for r in responses:
            batch_tokens[r.uid].append(r.token)
    for uid, prompt in zip(uids, prompts):
        assert batch_tokens[uid] == generated(model, prompt, caches())


def test_schemes(model):
    caches = schemes.get_scheme("8,4+rotate+center/g32").make_cache(model)
    assert all(type(c) is CenteredQuantizedKVCache for c in caches)
    assert (caches[0].bits, caches[0].group_size, caches[0].rotate) == (
        (8, 4),
        32,
        True,
    )
    assert caches[0].center == "k"
    assert schemes.get_scheme("4+center-kv/g64,32").bits_per_element == (4.5, 5.0)
    caches = schemes.get_scheme("codebook-3k-4v+center-kv").make_cache(model)
    assert caches[0].center == "kv" and caches[0].value_codec.bits == 4
    assert schemes.get_scheme("codebook-3+center").make_cache(model)[0].center == "k"
    window = schemes.windowed(schemes.get_scheme("4+rotate+center"), 64)
    caches = window.make_cache(model)
    assert type(caches[0]) is CenteredQuantizedRotatingKVCache
    assert (caches[0].max_size, caches[0].keep, caches[0].rotate) == (64, 4, True)
    assert type(centered(RotatingKVCache(8), "kv")) is CenteredQuantizedRotatingKVCache
    assert type(centered(QuantizedRotatingKVCache(8, bits=4))) is (
        CenteredQuantizedRotatingKVCache
    )


TINY_GEMMA = {
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 128,
    "sliding_window": 16,
    "sliding_window_pattern": 3,
}


def test_sliding_window_layers_as_whole_context_caches():
    # codebook schemes on a Gemma-like model: the sliding layers hold the whole
    # context and attend through the window mask, as the rotating cache does
    mx.random.seed(0)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(TINY_GEMMA))
    mx.eval(model.parameters())
    tokens = mx.random.randint(0, 128, (1, 50))
    assert any(type(c) is RotatingKVCache for c in make_prompt_cache(model))
    with pytest.raises(ValueError, match="plain KVCache"):
        schemes.plain_layers(model)

    def run(caches):
        steps = [tokens[:, i : i + 12] for i in range(0, 36, 12)]
        steps += [tokens[:, i : i + 1] for i in range(36, 50)]
        return mx.concatenate([model(s, cache=caches) for s in steps], axis=1)

    ref = run(make_prompt_cache(model))
    for name in ("codebook-16k-16v", "codebook-16k-16v+center-kv"):
        caches = schemes.get_scheme(name).make_cache(model)
        assert len(caches) == 3
        assert relative_error(run(caches), ref) < 1e-5
