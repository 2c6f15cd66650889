"""The codebook cache's score correction (``Codebook.debias``, ``+debias``):
the expected error it assumes, attention against a float32 reference that
applies it, what it corrects, and that it travels with the cache."""

import itertools

import mlx.core as mx
import pytest
from kv_helpers import fill, relative_error
from mlx_lm.models.base import create_causal_mask, scaled_dot_product_attention
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from tiny_llama import make_model

from omlx_cache import schemes
from omlx_cache.codebook import (
    BatchCodebookKVCache,
    Codebook,
    CodebookKVCache,
    codec,
    rotate,
)

PAGE = 64


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


def reference(cache, queries, mask):
    """float32 attention over the dequantized cache, each quantized key's
    score less half its expected error variance (the kept ones exact)."""
    keys, values = cache.dequantize()
    _, n_q, L, D = queries.shape
    scale = D**-0.5
    length = keys.shape[2]
    norms = mx.concatenate([page[1] for page in cache.key_pages], axis=2)
    variance = cache.key_codec.error_variance(norms[:, :, :length], D)[..., 0]
    kept = mx.arange(length) < cache._exact_count()
    variance = mx.where(kept, 0, variance)
    variance = mx.repeat(variance, n_q // keys.shape[1], axis=1)
    energy = (queries * queries).sum(-1, keepdims=True) * scale**2
    strength = float(cache.key_codec.debias)
    bias = -0.5 * strength * energy * variance[:, :, None, :]
    if mask == "causal":
        bias = mx.where(create_causal_mask(L, length - L), bias, -float("inf"))
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=bias
    )


@pytest.mark.parametrize(
    "new,groups,strength", [(1, 1, True), (1, 4, True), (29, 3, True), (29, 3, 3.5)]
)
def test_attention_matches_reference(new, groups, strength):
    mx.random.seed(new + groups)
    cache = CodebookKVCache(
        Codebook(3, debias=strength), 4, page_size=PAGE, center="k", keep_exact=4
    )
    keys, values = fill(cache, 2, 150, new, 64)
    queries = mx.random.normal((1, 2 * groups, new, 64)) * 3
    mask = "causal" if new > 1 else None
    out = scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=64**-0.5, mask=mask
    )
    want = reference(cache, queries, mask)
    assert relative_error(out, want) < 1e-4
    # and the correction is not nothing
    keys, values = cache.dequantize()
    uncorrected = mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=64**-0.5, mask=mask
    )
    assert relative_error(uncorrected, want) > 1e-3


def sink_weight(cache, queries, keys, values):
    """The attention weight of the first (kept) token: its value is one-hot
    on the last channel, the others' values zero there."""
    out = scaled_dot_product_attention(
        queries, *cache.update_and_fetch(keys, values), cache, 1.0, None
    )
    return out[..., -1].mean().item()


def test_it_keeps_an_exact_tokens_weight():
    # many keys whose scores are near the query's typical score, and one
    # kept token (a sink): without the correction their score errors,
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
        cache = CodebookKVCache(Codebook(2, debias=debias), 4, keep_exact=1)
        weights[debias] = sink_weight(cache, queries, keys, values)
    assert weights[False] < 0.97 * truth
    assert abs(weights[True] - truth) < 0.3 * abs(weights[False] - truth)


def test_the_setting_travels(tmp_path):
    assert codec(Codebook(4, debias=True).spec) == Codebook(4, debias=True)
    assert Codebook(4, debias=True).spec == "codebook-4-hadamard-dot-debias"
    scheme = schemes.get_scheme("codebook-4+center+qscale+exact8+k5@1+debias")
    caches = scheme.make_cache(make_model())
    assert [c.key_codec for c in caches] == [
        Codebook(4, debias=True),
        Codebook(5, debias=True),
    ]
    assert [c.value_codec for c in caches] == [Codebook(4), Codebook(4)]
    cache = CodebookKVCache(Codebook(4, debias=True), 4, page_size=PAGE)
    fill(cache, 2, 100, 1, 64)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, [cache])
    (loaded,) = load_prompt_cache(path)
    assert loaded.key_codec == Codebook(4, debias=True)


def test_a_scaled_correction_travels(tmp_path):
    assert Codebook(5, debias=3.5).spec == "codebook-5-hadamard-dot-debias3.5"
    assert codec("codebook-5-hadamard-dot-debias3.5") == Codebook(5, debias=3.5)
    scheme = schemes.get_scheme("codebook-5k-4v+center+qscale+exact8+debias3.5")
    caches = scheme.make_cache(make_model())
    assert {c.key_codec for c in caches} == {Codebook(5, debias=3.5)}
    cache = caches[0]
    fill(cache, 2, 100, 1, 64)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, [cache])
    (loaded,) = load_prompt_cache(path)
    assert loaded.key_codec == Codebook(5, debias=3.5)
    with pytest.raises(ValueError, match="debias must be 0 or more"):
        Codebook(4, debias=-1.0)


def test_a_batch_attends_as_its_caches_alone():
    mx.random.seed(4)
    caches = []
    for n in (5, 37, 70):
        caches.append(CodebookKVCache(Codebook(3, debias=True), 4, page_size=PAGE))
        fill(caches[-1], 2, n, n, 64)
    batch = CodebookKVCache.merge(caches)
    assert isinstance(batch, BatchCodebookKVCache)
    assert batch.key_codec.debias
    step = mx.random.normal((2, 3, 2, 1, 64))
    queries = mx.random.normal((3, 6, 1, 64)) * 3
    keys, values = batch.update_and_fetch(step[0], step[1])
    out = scaled_dot_product_attention(
        queries, keys, values, cache=batch, scale=0.125, mask=batch.make_mask(1)
    )
    for i, cache in enumerate(caches):
        k, v = cache.update_and_fetch(step[0, i : i + 1], step[1, i : i + 1])
        single = scaled_dot_product_attention(
            queries[i : i + 1], k, v, cache=cache, scale=0.125, mask=None
        )
        assert relative_error(out[i : i + 1], single) < 1e-4


def test_a_fitted_scheme_picks_the_layers_of_its_plain_twin():
    # +debias is ranked as the scheme without it: no second calibration
    name = "codebook-4+center+qscale+exact8+k5@fit4.6"
    plain = schemes.fit_names(name, "4", "5", "k")
    assert schemes.fit_names(name + "+debias", "4", "5", "k") == plain
    assert plain == (
        "codebook-4+center+qscale+exact8",
        "codebook-4k-16v+center+qscale+exact8",
    )
