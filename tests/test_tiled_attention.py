"""Tiled attention over the paged quantized cache against a float32 reference.

The reference is plain attention over the dequantized keys and values, so the
only difference allowed is float rounding: the tiling, the online softmax, the
page boundaries, the GQA folding and the masks must not change the result.
"""

import itertools

import mlx.core as mx
import pytest
from kv_helpers import fill, relative_error
from mlx_lm.models import base
from mlx_lm.models.base import create_causal_mask, scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache

PAGE = 64


@pytest.fixture(autouse=True)
def small_pages_and_tiles(monkeypatch):
    # small pages and tiles so that short contexts cross many of both
    monkeypatch.setattr(QuantizedKVCache, "page_size", PAGE)
    monkeypatch.setattr(base, "QUANTIZED_SDPA_TILE_SCORES", 2048)


def reference(cache, queries, mask):
    (k, v), head_dim = cache.keys_and_values(), queries.shape[-1]
    k = mx.dequantize(*k, group_size=cache.key_group_size, bits=cache.key_bits)
    v = mx.dequantize(*v, group_size=cache.value_group_size, bits=cache.value_bits)
    return mx.fast.scaled_dot_product_attention(
        queries, k, v, scale=head_dim**-0.5, mask=mask
    )


SHAPES = list(
    itertools.product(
        [64, 128, 256],  # head_dim
        [1, 3, 4, 8],  # query heads per key head
        [1, 65, 203],  # context length: one token, just past a page, many pages
    )
)


@pytest.mark.parametrize("head_dim,groups,length", SHAPES)
def test_decode_matches_reference(head_dim, groups, length):
    mx.random.seed(length + groups)
    n_kv = 2
    cache = QuantizedKVCache(group_size=64, bits=(8, 4))
    keys, values = fill(cache, n_kv, length, 1, head_dim)
    queries = mx.random.normal((1, n_kv * groups, 1, head_dim))
    out = scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=head_dim**-0.5, mask=None
    )
    assert out.shape == queries.shape
    assert relative_error(out, reference(cache, queries, None)) < 1e-4


@pytest.mark.parametrize("head_dim,groups,length", SHAPES[::2])
def test_prefill_chunk_matches_reference(head_dim, groups, length):
    mx.random.seed(length * groups)
    n_kv, new = 2, min(length, 37)
    cache = QuantizedKVCache(group_size=32, bits=4)
    keys, values = fill(cache, n_kv, length, new, head_dim)
    queries = mx.random.normal((1, n_kv * groups, new, head_dim))
    mask = "causal" if new > 1 else None
    out = scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=head_dim**-0.5, mask=mask
    )
    assert relative_error(out, reference(cache, queries, mask)) < 1e-4


@pytest.mark.parametrize("kind", ["bool", "additive", "per-head"])
def test_array_masks_with_batch(kind):
    mx.random.seed(7)
    batch, n_kv, groups, head_dim, length, new = 3, 2, 4, 64, 150, 20
    cache = QuantizedKVCache(group_size=64, bits=8)
    keys, values = fill(cache, n_kv, length, new, head_dim, batch=batch)
    queries = mx.random.normal((batch, n_kv * groups, new, head_dim))
    heads = n_kv * groups if kind == "per-head" else 1
    visible = mx.random.uniform(shape=(batch, heads, new, length)) > 0.5
    mask = create_causal_mask(new, length - new) & (visible | (mx.arange(length) == 0))
    if kind == "additive":
        mask = mx.where(mask, 0.0, -float("inf"))
    out = scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=head_dim**-0.5, mask=mask
    )
    assert relative_error(out, reference(cache, queries, mask)) < 1e-4


def test_reserved_cache_after_trim():
    mx.random.seed(3)
    cache = QuantizedKVCache(group_size=64, bits=(8, 4), reserve=100)
    fill(cache, 1, 90, 90, 64)
    cache.trim(40)
    keys, values = fill(cache, 1, 30, 30, 64)
    assert (cache.offset, cache.capacity) == (80, 104)  # rounded up to 8
    queries = mx.random.normal((1, 4, 30, 64))
    out = scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=0.125, mask="causal"
    )
    assert relative_error(out, reference(cache, queries, "causal")) < 1e-4


@pytest.mark.parametrize(
    "page_size,length,tile", [(257, 257, 64), (300, 77, 32), (13, 13, 8), (5, 5, 8)]
)
def test_tiles_cover_each_key_once_and_stay_aligned(page_size, length, tile):
    seen = []
    for start, new, stop in base._quantized_sdpa_tiles(page_size, length, tile):
        assert start <= new < stop <= page_size
        assert (stop - start) % 8 == 0 or stop - start == page_size
        seen.extend(range(new, stop))
    assert seen[: min(length, page_size)] == list(range(min(length, page_size)))
    assert len(set(seen)) == len(seen)


def test_tiles_stop_near_the_stored_keys():
    # a part-filled page costs what it holds, rounded up to 64 keys
    assert list(base._quantized_sdpa_tiles(4096, 100, 4096)) == [(0, 0, 128)]
    assert list(base._quantized_sdpa_tiles(4096, 128, 64)) == [
        (0, 0, 64),
        (64, 64, 128),
    ]
