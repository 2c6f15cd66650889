"""Codebook caches of sliding-window layers (``WindowedCodebookKVCache``):
the pages no query sees any more are dropped, attention stays the same."""

import mlx.core as mx
import pytest
from kv_helpers import relative_error
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from mlx_lm.server import _can_merge
from test_center_key_scale import tiny_gemma

from omlx_cache import blocks, models, schemes
from omlx_cache.codebook import CodebookKVCache, WindowedCodebookKVCache

SCHEME = "codebook-4+center+qscale+exact4"
# on CUDA the decode kernel splits a layer's keys by pages: other sums
ON_CUDA = mx.default_device() == mx.gpu and mx.cuda.is_available()


def same(a, b):
    return relative_error(a, b) < 2e-3 if ON_CUDA else mx.array_equal(a, b)


def whole_context(caches):
    """Caches like ``caches`` that keep every token (as before windows), in
    pages of the same size: the same tiles, so the same sums (a key near a
    codebook boundary makes float noise a different code in the next layer)."""
    return [
        CodebookKVCache(
            c.key_codec,
            c.value_codec,
            page_size=c.page_size,
            center=c.center,
            keep_exact=c.keep_exact,
            key_scale=c.key_scale,
        )
        for c in caches
    ]


def run(model, tokens, caches, start=0):
    """Logits of ``tokens`` from ``start`` on: 12-token chunks to 36, then
    one token at a time."""
    steps = [(i, min(i + 12, 36)) for i in range(start, 36, 12)]
    steps += [(i, i + 1) for i in range(max(start, 36), tokens.shape[1])]
    logits = [model(tokens[:, a:b], cache=caches) for a, b in steps]
    return mx.concatenate(logits, axis=1)


def test_sliding_layers_drop_pages_and_attend_as_before():
    model = tiny_gemma()
    tokens = mx.random.randint(0, 128, (1, 70))
    caches = schemes.get_scheme(SCHEME).make_cache(model)
    assert [type(c).__name__ for c in caches] == [
        "WindowedCodebookKVCache",
        "WindowedCodebookKVCache",
        "CodebookKVCache",
    ]
    whole = whole_context(caches)
    out = run(model, tokens, caches)
    assert same(out, run(model, tokens, whole))
    for c, w in zip(caches[:2], whole):
        assert c.window == 16 and c.page_size == 16
        assert c.dropped == 48 and c.offset == 70
        assert c.capacity <= c.max_size
        assert c.exact_keys is None  # the kept first tokens went with page 0
        assert c.nbytes < w.nbytes
    assert caches[2].capacity >= 70


def test_dropped_pages_survive_a_round_trip_through_a_file(tmp_path):
    model = tiny_gemma()
    tokens = mx.random.randint(0, 128, (1, 60))
    caches = schemes.get_scheme(SCHEME).make_cache(model)
    run(model, tokens[:, :50], caches)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert [(c.window, c.dropped, c.offset) for c in loaded[:2]] == [(16, 32, 50)] * 2
    more = tokens[:, 50:]
    ours, theirs = model(more, cache=caches), model(more, cache=loaded)
    assert relative_error(theirs, ours) < 1e-5


def test_a_cache_that_dropped_pages_is_not_trimmed_or_batched():
    cache = WindowedCodebookKVCache(16, 4, page_size=16)
    assert cache.max_size == 32
    k = mx.random.normal((1, 1, 20, 64))
    cache.update_and_fetch(k, k)
    assert cache.is_trimmable() and cache.trim(4) == 4
    for _ in range(3):
        cache.update_and_fetch(k, k)
    assert cache.dropped == 32 and not cache.is_trimmable()
    assert cache.trim(100) == 76 - 32
    with pytest.raises(NotImplementedError, match="does not batch"):
        cache.merge([cache])
    assert not _can_merge([cache])
    # the disk tier stores linear prefixes: a windowed cache has none
    assert blocks.layout_of(WindowedCodebookKVCache) is None
    with pytest.raises(ValueError, match="at least one token"):
        WindowedCodebookKVCache(0)


def test_the_mask_loses_the_dropped_columns():
    cache = WindowedCodebookKVCache(16, 4, page_size=16)
    k = mx.random.normal((1, 1, 40, 64))
    cache.update_and_fetch(k, k)
    # a call at offset 40 sees keys 25 on: tokens 0-15 go, 16-39 stay
    mask = cache.make_mask(8, window_size=16)
    assert mask.shape == (8, 48 - 16)
    assert cache.dropped == 0  # the mask drops nothing itself
    cache.update_and_fetch(k[:, :, :8], k[:, :, :8])
    assert cache.dropped == 16 and cache.capacity == 32


def test_bits_count_the_tokens_a_window_holds():
    model = tiny_gemma()
    caches = schemes.get_scheme(SCHEME).make_cache(model)
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=caches))
    bits = schemes.average_bits(caches, 4096)
    whole = whole_context(caches)
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=whole))
    # the same formats; fewer kept tokens and means for the same stored ones
    assert bits != schemes.average_bits(whole, 4096)
    assert abs(bits[0] - schemes.average_bits(whole, 4096)[0]) < 0.1


def test_gemma_past_its_window_as_with_every_token():
    # the real model's 512-token windows in pages of 128: one dropped at the
    # first decode step (the hidden states: the vocabulary's head is slow here)
    from mlx_lm import load

    f32_dir = models.import_model(models.MODELS["gemma3"], models.REPO_ROOT / "models")[
        1
    ]
    model, _ = load(str(f32_dir))
    tokens = mx.random.randint(0, 1000, (1, 644), key=mx.random.key(1))
    caches = [
        c
        if not isinstance(c, WindowedCodebookKVCache)
        else WindowedCodebookKVCache(
            c.window,
            c.key_codec,
            c.value_codec,
            page_size=128,
            center=c.center,
            keep_exact=c.keep_exact,
            key_scale=c.key_scale,
        )
        for c in schemes.get_scheme("codebook-4+center+qscale+exact8").make_cache(model)
    ]
    whole = whole_context(caches)

    def hidden(caches):
        steps = [(a, a + 160) for a in range(0, 640, 160)]
        steps += [(a, a + 1) for a in range(640, 644)]
        out = [model.model(tokens[:, a:b], cache=caches)[:, -1] for a, b in steps]
        return mx.stack(out, axis=1)

    assert same(hidden(caches), hidden(whole))
    windowed = [c for c in caches if isinstance(c, WindowedCodebookKVCache)]
    assert len(windowed) == 15
    assert all(c.dropped == 128 and c.exact_keys is None for c in windowed)
    assert sum(c.nbytes for c in caches) < sum(c.nbytes for c in whole)
