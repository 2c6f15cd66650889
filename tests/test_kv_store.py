"""The composed store (``omlx_cache.kv.KVStore``, ``BatchKVStore``): what it
attends equals float32 attention over what it holds; the first tokens, the
residual, centering and key weights, windows, state, trim and batches; and
chunked prefill on the real SmolLM2."""

import json

import mlx.core as mx
import pytest
from kv_helpers import (
    attend,
    codec_round,
    fill,
    float_attention,
    random_kv,
    reference,
    relative_error,
    stored,
)
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import BatchKVCache, KVCache
from tiny_gemma import tiny_gemma
from tiny_llama import CONFIG, make_model

from omlx_cache.kv import Affine, BatchKVStore, Codebook, KVStore, Plain, attention
from omlx_cache.kv.rotation import rotate
from omlx_cache.kv.spec import KVSpec
from omlx_cache.kv.transform import Transform, first_write_mean, query_key_weights

PAGE = 64
CODECS = {
    "codebook-3": (3, None),
    "codebook-3k-4v": (3, 4),
    "codebook-3k-affine4v": (3, Affine(4, 64)),
    "codebook-4-givens": (Codebook(4, "givens"), None),
    "codebook-4k-3v-n8": (Codebook(4, norm_bits=8), Codebook(3, norm_bits=8)),
    "codebook-3k-plain-v": (3, Plain()),
    "affine-8,4": (Affine(8), Affine(4, 32)),
    "affine-4-rotated": (Affine(4, 64, "hadamard"), None),
}
SETTINGS = {
    "plain": {},
    "first": {"first": 4},
    # a transform needs first tokens: 2, the fewest
    "center-kv": {"center": "kv", "first": 2},
    "residual": {"recent": 16},
    "weighted": {"center": "k", "key_scale": "qk", "first": 4},
    "everything": {"center": "kv", "key_scale": "q", "first": 16, "recent": 8},
}


def store(name="codebook-3k-4v", page_size=PAGE, **settings):
    return KVStore(*CODECS[name], page_size=page_size, **settings)


def same_storage(a, b):
    for x_parts, y_parts in zip(a.keys_and_values(), b.keys_and_values()):
        for x, y in zip(x_parts, y_parts):
            assert x.dtype == y.dtype and mx.array_equal(x, y)


# ---------------------------------------------------------------------------
# Attention over what the store holds


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("settings", list(SETTINGS))
@pytest.mark.parametrize("groups,length,new", [(1, 1, 1), (3, 65, 1), (4, 203, 37)])
def test_attention_over_what_the_store_holds(name, settings, groups, length, new):
    mx.random.seed(length + groups)
    s = store(name, **SETTINGS[settings])
    fill(s, 2, length, new, 64)
    queries = mx.random.normal((1, 2 * groups, new, 64))
    mask = "causal" if new > 1 else None
    out = attend(s, queries, mask)
    assert out.shape == queries.shape
    assert relative_error(out, reference(s, queries, mask)) < 1e-4


def test_update_returns_what_it_holds_and_counts_the_tokens():
    """``update_and_fetch`` returns the pages, or with ``fetch_dequantized``
    the keys and values as the model made them (what a model that attends
    by itself reads)."""
    s = store(page_size=16)
    assert s.empty() and s.size() == 0 and s.bits_per_element is None
    keys, values = random_kv(1, 2, 40, 64, seed=1)
    assert s.update_and_fetch(keys, values) == (s.key_pages, s.value_pages)
    assert len(s.key_pages) == 3
    s = store(page_size=16, fetch_dequantized=True)
    fetched = s.update_and_fetch(keys, values)
    assert s.settings["fetch_dequantized"]
    for got, want in zip(fetched, stored(s)):
        assert got.shape == (1, 2, 40, 64) and mx.allclose(got, want, atol=1e-5)
    assert (s.offset, s.size(), s.capacity) == (40, 40, 48)
    assert s.bits_per_element == (3.25, 4.25)
    assert s.max_size is None and s.is_trimmable() and not s.empty()
    assert s.make_mask(1) is None and s.make_mask(5) == "causal"
    assert s.make_mask(5, return_array=True).shape == (1, 1, 5, 45)


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"first": 4},
        {"first": 4, "center": "kv", "key_scale": "qk"},
        {"recent": 8},
        {"window": 24, "page_size": 16},
    ],
)
@pytest.mark.parametrize("batch", [False, True])
def test_what_a_model_that_attends_by_itself_reads(settings, batch):
    """Every write's ``update_and_fetch`` returns each row a query sees as the
    model made it (``stored``, within 8-bit rounding; a write that waits
    for the transform as it came), decode tokens held for a kernel
    included; attention over it with mx.fast equals the store's own when
    the model hands back what it fetched, and a model's own keys made from
    them (an MLA latent's projections) are attended as they are."""
    codecs = (Affine(8, 32, "hadamard"), Affine(8, 32))
    settings = dict(settings, fetch_dequantized=True)
    s = KVStore(*codecs, **settings)
    if batch:
        s = BatchKVStore([0, 3], *codecs, **settings)
    B = 2 if batch else 1
    assert s.fetch_dequantized
    keys, values = random_kv(B, 2, 9, 64, seed=3)
    for step, n in enumerate((9, 1, 7, 1, 1, 12, 1)):
        if step:
            keys, values = random_kv(B, 2, n, 64, seed=10 + step)
        mask = s.make_mask(n, return_array=True)  # as a model makes it
        fetched = s.update_and_fetch(keys, values)
        queries = mx.random.normal((B, 4, n, 64), key=mx.random.key(step))
        out = s.scaled_dot_product_attention(queries, *fetched, 64**-0.5, mask)
        if n == 1:  # (a padded prompt row sees no key)
            own = float_attention(queries, *fetched, mask)
            assert relative_error(out, own) < 2e-2
        for got, want in zip(fetched, stored(s)):
            assert got.shape == want.shape
            assert mx.abs(got - want).max().item() < 0.05
    projected = fetched[0] * 2
    out = s.scaled_dot_product_attention(queries, projected, fetched[1], 0.1, None)
    want = float_attention(queries, projected, fetched[1], None, scale=0.1)
    assert relative_error(out, want) < 1e-5


@pytest.mark.parametrize("bits", [3, 4])
def test_quantization_error_is_small(bits):
    # not a reference check: the codec itself, against exact attention
    keys, values = random_kv(1, 2, 300, 128, seed=5)
    queries = mx.random.normal((1, 8, 1, 128))
    exact = float_attention(queries, keys, values)
    errors = {}
    for b in (bits, bits + 1):
        s = KVStore(b)
        s.update_and_fetch(keys, values)
        out = attend(s, queries, None)
        errors[b] = (((out - exact) ** 2).sum() / (exact**2).sum()).item()
    assert errors[bits + 1] < errors[bits] < 0.1


def test_bits_per_element_and_bytes():
    for bits, dim in ((3, 64), (3, 128), (4, 128)):
        s = KVStore(bits, page_size=16)
        fill(s, 2, 10, 10, dim)
        assert s.bits_per_element == (bits + 16 / dim,) * 2
        keys = s.keys_and_values()[0]
        assert sum(x.nbytes for x in keys) * 8 / (2 * 10 * dim) == bits + 16 / dim
        assert s.nbytes == 2 * sum(x.nbytes for p in s.key_pages for x in p)


def test_settings_a_store_refuses():
    for settings, match in (
        ({"recent": 12}, "recent must be 0 or a multiple of 8"),
        ({"first": -1}, "first must be 0 or more"),
        ({"first": True}, "first must be a number of tokens"),
        ({"window": 16, "keep": 16}, "keep must be less than the window"),
        ({"window": 16, "recent": 8}, "needs a store without a window"),
        ({"center": "v"}, "center must be one of"),
        ({"key_scale": "k"}, "key_scale must be one of"),
        # a transform is measured on the first tokens (the first left out)
        ({"center": "k"}, "first must be 2 or more, got 0"),
        ({"key_scale": "q", "first": 1}, "first must be 2 or more, got 1"),
        ({"center": "kv", "window": 16, "keep": 1}, "first must be 2 or more"),
    ):
        with pytest.raises(ValueError, match=match):
            KVStore(3, **settings)


def test_a_head_dim_the_codecs_cannot_store():
    """The first write fits the codecs to the head dim (``codecs.for_dim``):
    a smaller group size, else unquantized; attention as over what it holds."""
    store = KVStore(Affine(4, 64))
    keys, values = random_kv(1, 2, 5, 96)
    store.update_and_fetch(keys, values)
    assert store.key_codec == Affine(4, 32) == store.value_codec
    store = KVStore(3)
    keys, values = random_kv(1, 2, 5, 48)
    pages = store.update_and_fetch(keys, values)
    assert store.key_codec.spec == "plain" == store.value_codec.spec
    queries = mx.random.normal((1, 4, 5, 48), key=mx.random.key(5))
    out = store.scaled_dot_product_attention(
        queries, *pages, scale=48**-0.5, mask="causal"
    )
    ref = float_attention(queries, keys, values, "causal")
    assert relative_error(out, ref) < 1e-5


# ---------------------------------------------------------------------------
# The first tokens


@pytest.mark.parametrize(
    "name", ["codebook-3", "codebook-3k-affine4v", "codebook-4k-3v-n8", "affine-8,4"]
)
@pytest.mark.parametrize("center", ["", "k", "kv"])
@pytest.mark.parametrize(
    "n,lengths", [(4, (50, 1)), (16, (9, 30, 1)), (2, (70,)), (1, (70,))]
)
def test_first_tokens_are_read_as_they_came(name, center, n, lengths):
    if center and n < 2:
        with pytest.raises(ValueError, match="first must be 2 or more"):
            store(name, center=center, first=n)
        return
    total = sum(lengths)
    keys, values = random_kv(1, 2, total, 64, seed=n + len(lengths), offset=2)
    kept = store(name, center=center, first=n)
    start = 0
    for length in lengths:
        k, v = (x[..., start : start + length, :] for x in (keys, values))
        kept.update_and_fetch(k, v)
        start += length
        queries = mx.random.normal((1, 6, length, 64))
        mask = "causal" if length > 1 else None
        out = attend(kept, queries, mask)
        assert relative_error(out, reference(kept, queries, mask)) < 1e-4
    assert kept.spans.first_keys.shape[2] == n
    # the means: of the first n tokens, the first left out
    t = kept.transform
    if center:
        mean = keys[:, :, 1:n].mean(axis=2, keepdims=True)
        assert mx.allclose(t.key_mean, mean, atol=1e-5)
    if center == "kv":
        mean = values[:, :, 1:n].mean(axis=2, keepdims=True)
        assert mx.allclose(t.value_mean, mean, atol=1e-5)
    # what attention reads: the first n tokens as they came, the rest as
    # the codecs hold them centered
    k, v = stored(kept)
    count = min(n, total)
    assert mx.allclose(k[:, :, :count], keys[:, :, :count], atol=1e-4)
    assert mx.allclose(v[:, :, :count], values[:, :, :count], atol=1e-4)
    rest = [x[:, :, count:] for x in t(keys, values)]
    rest = [codec_round(c, x) for c, x in zip((kept.key_codec, kept.value_codec), rest)]
    if t.key_mean is not None:
        rest[0] = rest[0] + t.key_mean
    if t.value_mean is not None:
        rest[1] = rest[1] + t.value_mean
    assert mx.array_equal(k[:, :, count:], rest[0])
    assert mx.array_equal(v[:, :, count:], rest[1])


@pytest.mark.parametrize("name", ["codebook-3", "affine-4-rotated"])
def test_first_tokens_of_each_sequence_of_a_store(name):
    # a KVStore of two sequences (no padding): each keeps its own
    keys, values = random_kv(2, 2, 40, 64, seed=2)
    s = store(name, first=8)
    s.update_and_fetch(keys[:, :, :30], values[:, :, :30])
    s.update_and_fetch(keys[:, :, 30:], values[:, :, 30:])
    assert s.spans.first_keys.shape == (2, 2, 8, 64)
    assert mx.allclose(stored(s)[0][:, :, :8], keys[:, :, :8], atol=1e-4)
    queries = mx.random.normal((2, 4, 10, 64))
    out = attend(s, queries, "causal")
    assert relative_error(out, reference(s, queries, "causal")) < 1e-4


def test_first_tokens_lower_the_error():
    keys, values = random_kv(1, 2, 40, 64, seed=0)
    keys = keys.at[..., 0, :].multiply(20)  # an outlier first key, as sinks are
    queries = mx.random.normal((1, 4, 1, 64))
    exact = float_attention(queries, keys, values)
    errors = []
    for n in (0, 1):
        s = KVStore(3, first=n)
        s.update_and_fetch(keys, values)
        errors.append(relative_error(attend(s, queries, None), exact))
    assert errors[1] < errors[0]


def test_the_pages_begin_after_a_sequences_first_tokens():
    """A KVStore's first tokens are in the first span only: its pages hold
    rows ``first`` on (``dropped`` of them kept out), whatever the chunks;
    a state says so, and attention reads the first span at rows -first to
    -1 (nothing in the pages to hide)."""
    keys, values = random_kv(1, 2, 30, 64, seed=4)
    for cuts in ((30,), (3, 5, 8, 30), (20, 21, 30)):
        s = KVStore(3, page_size=PAGE, first=8)
        start = 0
        for stop in cuts:
            s.update_and_fetch(keys[:, :, start:stop], values[:, :, start:stop])
            assert s.dropped == min(stop, 8) and s._written == stop
            start = stop
        pages = s.keys_and_values()[0]
        want = s.key_codec.encode(keys[:, :, 8:])
        assert all(mx.array_equal(x, y) for x, y in zip(pages, want))
        call_first = s._first(mx.zeros((1, 2, 1, 64)))
        assert (call_first.first, call_first.count) == (-8, 8)
        loaded = KVStore.from_state(s.state)
        assert (loaded.dropped, loaded._written) == (8, 30)
        same_storage(loaded, s)
    # short of its first tokens: none in the pages
    short = KVStore(3, page_size=PAGE, first=8)
    short.update_and_fetch(keys[:, :, :5], values[:, :, :5])
    assert (short.dropped, short._written, short.key_pages) == (5, 5, [])
    queries = mx.random.normal((1, 4, 5, 64))
    out = attend(short, queries, "causal")
    assert (
        relative_error(out, float_attention(queries, *stored(short), "causal")) < 1e-6
    )
    assert (
        relative_error(
            out, float_attention(queries, keys[:, :, :5], values[:, :, :5], "causal")
        )
        < 1e-4
    )


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("cuts", [(20,), (5, 20), (8, 9, 20)])
def test_a_mask_array_shows_the_first_tokens_as_causal_does(kind, cuts):
    """Models that ask for mask arrays (``return_array=True``: gemma2,
    deepseek_v3): the mask covers the rows the store attended before the
    write (read right-aligned), not the first tokens before the pages; a
    query sees those at or after its row, as with "causal"."""
    keys, values = random_kv(1, 2, 20, 64, seed=6)
    queries = mx.random.normal((1, 4, 20, 64))
    stores = [KVStore(4, page_size=PAGE, first=8) for _ in range(2)]
    start = 0
    for stop in cuts:
        outs = []
        for s, array in zip(stores, (False, True)):
            mask = s.make_mask(stop - start, return_array=array)
            if mask is not None and array and kind == "additive":
                mask = mx.where(mask, 0.0, -float("inf"))
            s.update_and_fetch(keys[:, :, start:stop], values[:, :, start:stop])
            outs.append(attend(s, queries[:, :, start:stop], mask))
        assert relative_error(outs[1], outs[0]) < 1e-6, stop
        start = stop


def test_trim_below_the_first_tokens_then_write():
    keys, values = random_kv(1, 1, 30, 64, seed=3)
    s = KVStore(3, page_size=PAGE, first=8)
    s.update_and_fetch(keys[..., :20, :], values[..., :20, :])
    # the first tokens kept out of the pages are no dropped rows: trimmable
    assert s.dropped == 8 and s.is_trimmable()
    assert s.trim(15) == 15 and s.offset == 5
    # into the first tokens: the pages hold none of the rows left
    assert (s.dropped, s._written) == (5, 5)
    s.update_and_fetch(keys[..., 20:, :], values[..., 20:, :])
    assert (s.dropped, s._written) == (8, 15)
    new_keys = mx.concatenate([keys[..., :5, :], keys[..., 20:, :]], axis=2)
    assert mx.array_equal(s.spans.first_keys, rotate(new_keys[..., :8, :], "hadamard"))
    queries = mx.random.normal((1, 2, 1, 64))
    assert relative_error(attend(s, queries, None), reference(s, queries, None)) < 1e-4
    assert mx.allclose(stored(s)[0][:, :, :8], new_keys[:, :, :8], atol=1e-4)


# ---------------------------------------------------------------------------
# The residual (recent tokens)


def test_residual_holds_r_to_2r_minus_1_tokens():
    s = KVStore(Affine(4, 64, "hadamard"), recent=8)
    keys, values = random_kv(1, 2, 30, 64, seed=4)
    held = []
    for t in range(30):
        s.update_and_fetch(keys[:, :, t : t + 1], values[:, :, t : t + 1])
        held.append(s.spans.n_held)
        assert s._written + s.spans.n_held == s.offset == t + 1
    # 1..15 held, then 8 written to the pages at a time as the 16th comes
    assert held == list(range(1, 16)) + list(range(8, 16)) + list(range(8, 15))
    # the held ones are attended as they came, the written ones quantized
    k, v = stored(s)
    assert mx.allclose(k[:, :, 16:], keys[:, :, 16:], atol=1e-4)
    assert mx.allclose(v[:, :, 16:], values[:, :, 16:], atol=1e-4)
    assert not mx.allclose(k[:, :, :16], keys[:, :, :16], atol=1e-2)
    queries = mx.random.normal((1, 4, 1, 64))
    assert relative_error(attend(s, queries, None), reference(s, queries, None)) < 1e-4
    # a chunk writes all but R to 2R - 1 of its tokens at once
    chunk = KVStore(Affine(4, 64, "hadamard"), recent=8)
    chunk.update_and_fetch(keys, values)
    assert (chunk.spans.n_held, chunk._written) == (14, 16)
    same_storage(chunk, s)


def test_trim_takes_the_residuals_tokens_first():
    s = KVStore(Affine(8), recent=8)
    keys, values = random_kv(1, 2, 27, 64, seed=5)
    s.update_and_fetch(keys, values)
    assert (s.spans.n_held, s._written) == (11, 16)
    assert s.trim(3) == 3 and (s.spans.n_held, s._written, s.offset) == (8, 16, 24)
    assert s.trim(10) == 10 and (s.spans.n_held, s._written, s.offset) == (0, 14, 14)
    s.update_and_fetch(keys[:, :, :5], values[:, :, :5])
    queries = mx.random.normal((1, 4, 1, 64))
    assert relative_error(attend(s, queries, None), reference(s, queries, None)) < 1e-4
    assert s.offset == 19


@pytest.mark.parametrize("cuts", [range(1, 21), (5, 9, 10, 20)])
def test_a_residuals_writes_without_attention_keep_their_order(cuts):
    """The write that completes the first tokens waits for its attention
    call; a write that comes first (no attention between) goes after it."""
    keys, values = random_kv(1, 2, 20, 64, seed=1, offset=2)
    s = KVStore(
        Affine(4, 64, "hadamard"), center="k", key_scale="qk", first=8, recent=16
    )
    start = 0
    for stop in cuts:
        s.update_and_fetch(keys[:, :, start:stop], values[:, :, start:stop])
        start = stop
    assert (s._idx, s.spans.n_held) == (20, 20)
    k, v = stored(s)  # every token held: as it came
    assert mx.allclose(k, keys, atol=1e-5) and mx.allclose(v, values, atol=1e-5)


# ---------------------------------------------------------------------------
# Centering


@pytest.mark.parametrize("center", ["k", "kv"])
@pytest.mark.parametrize("batch,groups", [(1, 1), (2, 3)])
@pytest.mark.parametrize("cut", [40, 3])
def test_unquantized_centered_store_attends_as_float(center, batch, groups, cut):
    # lossless codecs: only the centering differs; the first 8 tokens fix it,
    # in the first write or (cut 3) in the chunk after a decode token
    keys, values = random_kv(batch, 2, 90, 64, seed=groups, offset=4)
    s = KVStore(Plain(), Plain(), page_size=64, center=center, first=8)
    for start, stop in ((0, cut), (cut, cut + 1), (cut + 1, 90)):
        s.update_and_fetch(keys[:, :, start:stop], values[:, :, start:stop])
        queries = mx.random.normal((batch, 2 * groups, stop - start, 64))
        mask = "causal" if stop - start > 1 else None
        out = attend(s, queries, mask)
        ref = float_attention(queries, keys[:, :, :stop], values[:, :, :stop], mask)
        assert relative_error(out, ref) < 1e-5
        assert s.transform.fixed == (stop >= 8)
    assert (s.transform.value_mean is not None) == (center == "kv")


def test_centering_cuts_the_error_of_offset_keys():
    keys, values = random_kv(1, 2, 200, 64, seed=5, offset=4)
    queries = mx.random.normal((1, 4, 1, 64))
    exact = float_attention(queries, keys, values)
    errors = {}
    for center in ("", "k", "kv"):
        s = KVStore(Affine(4, 64), center=center, first=4)
        s.update_and_fetch(keys, values)
        errors[center] = ((attend(s, queries, None) - exact) ** 2).sum().item()
    assert errors["kv"] < errors["k"] < errors[""]


@pytest.mark.parametrize("cuts", [(30,), (5, 30), (1, 2, 3, 30)])
def test_mean_of_the_first_tokens_then_frozen(cuts):
    keys, values = random_kv(2, 2, 40, 64, seed=2, offset=4)
    s = KVStore(Affine(4, 64), center="kv", first=8)
    start = 0
    for stop in cuts:
        s.update_and_fetch(keys[:, :, start:stop], values[:, :, start:stop])
        if stop < 8:
            # no transform before the first tokens are complete: the pages
            # hold them as they came (attention reads the first span)
            assert not s.transform.fixed and s._pending is None
            pages = s.keys_and_values()[0]
            want = s.key_codec.encode(keys[:, :, :stop])
            assert all(mx.array_equal(x, y) for x, y in zip(pages, want))
            attend(s, mx.random.normal((2, 4, stop - start, 64)), "causal")
        start, last = stop, stop - start
    # the write that completes them waits for its attention call
    assert s._pending is not None and s.transform.key_mean is None
    attend(s, mx.random.normal((2, 4, last, 64)), "causal")
    # the means of the first tokens but the first (often a sink)
    t = s.transform
    assert mx.allclose(t.key_mean, keys[:, :, 1:8].mean(axis=2, keepdims=True))
    assert mx.allclose(t.value_mean, values[:, :, 1:8].mean(2, keepdims=True))
    assert t.key_mean.shape == (2, 2, 1, 64) and t.key_mean.dtype == mx.float32
    frozen = mx.array(t.key_mean)
    s.update_and_fetch(keys[:, :, 30:] + 100, values[:, :, 30:])
    s.trim(40)
    s.update_and_fetch(keys, values)
    assert mx.array_equal(s.transform.key_mean, frozen)


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


def test_sinks_with_centered_keys():
    keys, values = random_kv(1, 2, 100, 64, seed=11, offset=4)
    queries = mx.random.normal((1, 6, 9, 64))
    sinks = mx.random.normal((6,)) * 3
    mask = mx.ones((9, 100), mx.bool_)
    s = KVStore(Plain(), Plain(), center="k", first=4)
    s.update_and_fetch(keys, values)
    ref = float_attention(queries, keys, values, mask, sinks)
    assert relative_error(attend(s, queries, mask, sinks), ref) < 1e-5
    s = KVStore(Plain(), Plain(), center="kv", first=4)
    s.update_and_fetch(keys, values)
    with pytest.raises(ValueError, match="sinks"):
        attend(s, queries, mask, sinks)


@pytest.fixture(scope="module")
def model():
    return make_model()


def test_model_logits_unchanged_through_chunks(model):
    tokens = mx.random.randint(0, 320, (2, 70), key=mx.random.key(1))

    def run(caches):
        chunks = (tokens[:, :32], tokens[:, 32:33], tokens[:, 33:])
        return mx.concatenate([model(c, cache=caches) for c in chunks], axis=1)

    ref = run([KVCache() for _ in range(2)])
    for center in ("k", "kv"):
        caches = [KVStore(Plain(), Plain(), center=center, first=8) for _ in range(2)]
        assert relative_error(run(caches), ref) < 1e-5


# ---------------------------------------------------------------------------
# Key weights


def skewed(length, seed, batch=1):
    """Keys small where queries are large (channel by channel), with a large
    common part; 2 query heads per KV head."""
    mx.random.seed(seed)
    keys = mx.random.normal((batch, 2, length, 64)) * mx.linspace(0.2, 3, 64) + 2
    values = mx.random.normal((batch, 2, length, 64))
    queries = mx.random.normal((batch, 4, length, 64)) * mx.linspace(3, 0.2, 64)
    return keys, values, queries


def first_weights(keys, queries, n, mode, center):
    """The key weights of a sequence's first ``n`` tokens (1 to n - 1, the
    first left out): its queries' mean squares there, over the query heads
    of each KV head, and (``qk``) the centered keys' energies."""
    B, n_kv = keys.shape[:2]
    energy = mx.square(queries[:, :, 1:n]).mean(axis=2, keepdims=True)
    energy = energy.reshape(B, n_kv, -1, 1, keys.shape[-1]).mean(axis=2)
    first = keys[:, :, :n]
    if center:
        first = first - first[:, :, 1:].mean(axis=2, keepdims=True)
    return query_key_weights(first, energy, mode, stop=n)


@pytest.mark.parametrize("mode", ["qk", "q"])
@pytest.mark.parametrize("center,n,recent", [("", 2, 0), ("k", 4, 0), ("kv", 16, 16)])
def test_key_weights_are_set_by_the_first_tokens_queries(mode, center, n, recent):
    keys, values, queries = skewed(60, seed=9)
    s = KVStore(3, 4, center=center, first=n, recent=recent, key_scale=mode)
    s.update_and_fetch(keys[..., :50, :], values[..., :50, :])
    # the write that completes the first tokens waits for their queries
    assert s._pending is not None and not s.empty() and s.offset == 50
    assert s.transform.key_weights is None and not s.key_pages
    out = attend(s, queries[:, :, :50], "causal")
    weights = s.transform.key_weights
    assert weights.shape == (1, 2, 1, 64) and s._pending is None
    # the queries at positions 1 to n - 1 set them
    want = first_weights(keys, queries, n, mode, center)
    assert mx.allclose(weights, want, rtol=1e-5, atol=1e-6)
    # the first channels weigh more: large queries, small keys
    assert (weights[..., :8].mean() > 2 * weights[..., -8:].mean()).item()
    assert relative_error(out, reference(s, queries[:, :, :50], "causal")) < 1e-4
    s.update_and_fetch(keys[..., 50:, :], values[..., 50:, :])
    out = attend(s, queries[:, :, 50:], "causal")
    assert relative_error(out, reference(s, queries[:, :, 50:], "causal")) < 1e-4
    assert mx.array_equal(s.transform.key_weights, weights)
    assert mx.allclose(stored(s)[0][..., :n, :], keys[..., :n, :], atol=1e-4)


@pytest.mark.parametrize("mode", ["qk", "q"])
@pytest.mark.parametrize("cuts", [(1, 2, 3, 4, 5, 20), (3, 5, 20), (6, 20), (20,)])
def test_key_weights_take_the_queries_of_every_call_at_the_first_positions(mode, cuts):
    """Prefilled in chunks, token by token or in one: each attention call
    adds its queries at positions 1 to first - 1; the call after the write
    that completes the first tokens fixes the weights. The same weights,
    whatever the chunks (float sums: to rounding)."""
    keys, values, queries = skewed(20, seed=4)
    s = KVStore(Affine(4, 64, "hadamard"), center="k", key_scale=mode, first=6)
    start = 0
    for stop in cuts:
        mask = s.make_mask(stop - start)
        s.update_and_fetch(keys[:, :, start:stop], values[:, :, start:stop])
        assert s.transform.fixed == (start >= 6)
        out = attend(s, queries[:, :, start:stop], mask)
        assert s.transform.fixed == (stop >= 6)
        want = reference(s, queries[:, :, start:stop], mask)
        assert relative_error(out, want) < 1e-4
        start = stop
    want = first_weights(keys, queries, 6, mode, "k")
    assert mx.allclose(s.transform.key_weights, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["qk", "q"])
@pytest.mark.parametrize("codec", [Codebook(3), Affine(4, 64, "hadamard")])
def test_key_weights_lower_the_score_error(mode, codec):
    keys, values, queries = skewed(200, seed=3)
    errors = []
    for scale in ("", mode):
        s = KVStore(codec, center="k", key_scale=scale, first=16)
        s.update_and_fetch(keys, values)
        attend(s, queries, "causal")
        # query heads 0 and 2 read kv heads 0 and 1
        error = stored(s)[0] - keys
        scores = queries[:, ::2] @ error.swapaxes(-1, -2)
        errors.append((scores**2).mean().item())
    assert errors[1] < 0.8 * errors[0]


@pytest.mark.parametrize("read", ["state", "trim", "write", "pages"])
@pytest.mark.parametrize("seen", [0, 4])
def test_a_read_before_attention_fixes_the_weights_with_the_queries_seen(read, seen):
    """A read (state, trim, a write, the pages) between the write that
    completes the first tokens and its attention call fixes the transform
    with the queries seen so far: weights of ones when none were seen (the
    pages then as a store without weights has them), else theirs."""
    keys, values, queries = skewed(30, seed=5)
    plain = KVStore(Affine(4, 64), center="k", first=8)
    s = KVStore(Affine(4, 64), center="k", key_scale="q", first=8)
    for c in (plain, s):
        if seen:
            c.update_and_fetch(keys[:, :, :seen], values[:, :, :seen])
            attend(c, queries[:, :, :seen], "causal")
        c.update_and_fetch(keys[:, :, seen:], values[:, :, seen:])
    assert s._pending is not None and s.transform.key_weights is None
    if read == "state":
        assert s.state[-6] == 30  # offset
    elif read == "trim":
        assert s.trim(0) == 0
    elif read == "write":
        # (written in turn at the next attention call or read)
        s.update_and_fetch(keys[:, :, :1], values[:, :, :1])
        assert s._pending[2] == 30
    else:
        s.keys_and_values()
    assert s.transform.fixed and (s._pending is None or read == "write")
    weights = s.transform.key_weights
    if not seen:
        assert (weights == 1).all().item()
        pages, want = s.keys_and_values()[0], plain.keys_and_values()[0]
        # rows 8 to 29: the pages begin after the first tokens
        assert s.dropped == plain.dropped == 8
        assert all(mx.array_equal(x[:, :, :22], y) for x, y in zip(pages, want))
    else:
        # the queries at positions 1 to 3: the first call's
        want = first_weights(keys, queries, seen, "q", "")
        assert not (weights == 1).all().item()
        assert mx.allclose(weights, want, rtol=1e-5, atol=1e-6)
    # and later queries at the first positions change nothing
    attend(s, queries[:, :, -1:], None)
    assert mx.array_equal(s.transform.key_weights, weights)


def test_a_batch_weighs_each_sequence_by_its_own_queries():
    # padding left out of the means and the weights
    keys, values, queries = skewed(12, seed=13, batch=2)
    batch = BatchKVStore([3, 0], 3, center="k", key_scale=True, first=4)
    mask = batch.make_mask(12)
    batch.update_and_fetch(keys, values)
    out = attend(batch, queries, mask)
    for i, pad in enumerate((3, 0)):
        single = KVStore(3, center="k", key_scale=True, first=4)
        single.update_and_fetch(keys[i : i + 1, :, pad:], values[i : i + 1, :, pad:])
        want = attend(single, queries[i : i + 1, :, pad:], "causal")
        t, ts = batch.transform, single.transform
        assert mx.allclose(t.key_weights[i], ts.key_weights[0], rtol=1e-4)
        assert mx.allclose(t.key_mean[i], ts.key_mean[0], atol=1e-5)
        assert relative_error(out[i : i + 1, :, pad:], want) < 1e-4


@pytest.mark.parametrize("mode", ["qk", "q"])
@pytest.mark.parametrize("window", [None, 128])
def test_weighted_8_bit_stores_attend_as_float(mode, window):
    # a window never full here: the same as a store of every token
    keys, values, queries = skewed(60, seed=1)
    s = KVStore(Affine(8), center="k", key_scale=mode, first=8, window=window)
    outs, start = [], 0
    for stop in (40, 41, 60):  # prefill, decode, chunk
        mask = s.make_mask(stop - start)
        s.update_and_fetch(keys[:, :, start:stop], values[:, :, start:stop])
        outs.append(attend(s, queries[:, :, start:stop], mask))
        start = stop
    ref = float_attention(queries, keys, values, "causal")
    assert s.transform.key_weights.shape == (1, 2, 1, 64) and s.offset == 60
    assert relative_error(mx.concatenate(outs, axis=2), ref) < 2e-2


def test_generation_through_weighted_8_bit_stores(model):
    prompt = mx.array(list(range(3, 40)))

    def tokens(caches):
        steps = generate_step(prompt, model, max_tokens=8, prompt_cache=caches)
        return [int(t) for t, _ in steps]

    ref = tokens([KVCache() for _ in model.layers])
    weighted = [
        KVStore(Affine(8), center="k", key_scale="qk", first=8) for _ in model.layers
    ]
    assert tokens(weighted) == ref
    assert all(c.transform.key_weights is not None for c in weighted)


# ---------------------------------------------------------------------------
# Windows


def run_gemma(model, tokens, caches, start=0):
    """Logits of ``tokens`` from ``start`` on: 12-token chunks to 36, then
    one token at a time."""
    steps = [(i, min(i + 12, 36)) for i in range(start, 36, 12)]
    steps += [(i, i + 1) for i in range(max(start, 36), tokens.shape[1])]
    return mx.concatenate([model(tokens[:, a:b], cache=caches) for a, b in steps], 1)


class WindowedFirst(KVStore):
    """A store of every token whose first tokens a query sees within
    ``sliding`` rows, as the model's windowed mask shows it the others: that
    mask covers the pages only, and the first tokens are before them (a
    store without a window reads them causally)."""

    def __init__(self, sliding, **settings):
        super().__init__(**settings)
        self.sliding = sliding

    def _first(self, queries):
        first = super()._first(queries)
        if first is None:
            return None
        rows = mx.arange(first.count)
        q = mx.arange(self._idx - queries.shape[2], self._idx)[:, None]
        visible = (rows <= q) & (q - rows < self.sliding)
        return first._replace(mask=visible[None, None])


def whole_context(caches):
    """Stores like ``caches`` that keep every token, in pages of the same
    size (beginning after the same first tokens): the same tiles, so the
    same sums."""
    out = []
    for c in caches:
        settings = {k: v for k, v in c.settings.items() if k not in ("window", "keep")}
        settings["first"] = c.spans.first
        if c.window is None:
            out.append(KVStore(**settings))
        else:
            out.append(WindowedFirst(c.window, **settings))
    return out


SCHEME = "codec=codebook bits=4 center=k qscale=qk first=4"


def test_sliding_layers_drop_pages_and_attend_as_before():
    model = tiny_gemma()
    tokens = mx.random.randint(0, 128, (1, 70), key=mx.random.key(2))
    caches = KVSpec.parse(SCHEME).make_cache(model)
    assert [c.window for c in caches] == [16, 16, None]
    whole = whole_context(caches)
    out = run_gemma(model, tokens, caches)
    assert mx.array_equal(out, run_gemma(model, tokens, whole))
    for c, w in zip(caches[:2], whole):
        # the first 4 rows (the pages begin after them) and three pages of 16
        assert (c.page_size, c.dropped, c.offset) == (16, 4 + 48, 70)
        assert c.capacity <= c.window + c.page_size
        # the first tokens went once no query saw them
        assert c.spans.first_keys is None
        assert c.nbytes < w.nbytes and not c.is_trimmable()
    # a layer of every token: its pages begin after the first 4
    assert caches[2].capacity >= 66 and caches[2].dropped == 4


def test_the_mask_loses_the_dropped_columns():
    s = KVStore(Codebook(4), window=16, page_size=16)
    assert s.max_size == 16
    k = mx.random.normal((1, 1, 40, 64))
    s.update_and_fetch(k, k)
    # a call at offset 40 sees rows 25 on: rows 0-15 go, 16-47 stay
    mask = s.make_mask(8)
    assert mask.shape == (1, 1, 8, 48 - 16)
    assert s.dropped == 0  # the mask drops nothing itself
    s.update_and_fetch(k[:, :, :8], k[:, :, :8])
    assert s.dropped == 16 and s.capacity == 32


def test_a_store_that_dropped_pages_trims_no_further():
    s = KVStore(Codebook(4), window=32, page_size=16)
    k = mx.random.normal((1, 1, 20, 64))
    s.update_and_fetch(k, k)
    assert s.is_trimmable() and s.trim(4) == 4
    for _ in range(3):
        s.update_and_fetch(k, k)
    # the last write's queries (rows 56-75) see rows 25 on: page 0 went
    assert s.dropped == 16 and not s.is_trimmable()
    assert s.trim(100) == 76 - 16 and s.offset == 16
    s.update_and_fetch(k, k)
    assert s.offset == 36 and s._written == 36 and s.dropped == 16
    # sinks kept out of the pages are no dropped rows: trimmed below them
    sinks = KVStore(Codebook(4), window=32, keep=4, page_size=16)
    sinks.update_and_fetch(k, k)
    assert sinks.dropped == 4 and sinks.is_trimmable()
    assert sinks.trim(18) == 18 and (sinks.offset, sinks.dropped) == (2, 2)


def test_a_window_keeps_its_sinks():
    # keep=4: the first 4 tokens stay visible (in the first span) while the
    # pages that held them are dropped; the others within window - keep
    keys, values = random_kv(1, 2, 90, 64, seed=6)
    s = KVStore(Codebook(4), window=24, keep=4, page_size=16)
    assert s.spans.first == 4
    whole = KVStore(Codebook(4), first=4, page_size=16)
    for t in range(90):
        step = [x[:, :, t : t + 1] for x in (keys, values)]
        mask = s.make_mask(1)
        s.update_and_fetch(*step)
        whole.update_and_fetch(*step)
        if t % 15 == 14:
            queries = mx.random.normal((1, 4, 1, 64))
            visible = (mx.arange(t + 1) < 4) | (mx.arange(t + 1) > t - 20)
            want = attend(whole, queries, visible)
            assert relative_error(attend(s, queries, mask), want) < 1e-5
    # the first 4 rows, in the first span only, and four pages of 16 after them
    assert s.dropped == 4 + 64 and s.spans.first_keys is not None


def test_lossless_stores_attend_as_the_models_own_caches():
    # windows of Plain codecs (centered too): the model's own rotating caches
    from mlx_lm.models.cache import make_prompt_cache

    model = tiny_gemma()
    tokens = mx.random.randint(0, 128, (1, 50), key=mx.random.key(4))
    ref = run_gemma(model, tokens, make_prompt_cache(model))
    for center in ("", "kv"):
        scheme = f"bits=16 center={center or 'none'} first=4"
        caches = KVSpec.parse(scheme).make_cache(model)
        assert [c.window for c in caches] == [16, 16, None]
        assert relative_error(run_gemma(model, tokens, caches), ref) < 1e-5


def test_a_window_round_trips_through_its_state():
    model = tiny_gemma()
    tokens = mx.random.randint(0, 128, (1, 60), key=mx.random.key(3))
    caches = KVSpec.parse(SCHEME).make_cache(model)
    run_gemma(model, tokens[:, :50], caches)
    loaded = [type(c).from_state(c.state) for c in caches]
    # the first 4 tokens (in the first span only) and a page of 16 after them
    assert [(c.window, c.dropped, c.offset) for c in loaded[:2]] == [(16, 20, 50)] * 2
    more = tokens[:, 50:]
    assert mx.array_equal(model(more, cache=loaded), model(more, cache=caches))


# ---------------------------------------------------------------------------
# State


KINDS = {
    "codebook": lambda: store(),
    "affine-first-center": lambda: store("affine-8,4", first=4, center="kv"),
    "residual": lambda: store("affine-4-rotated", recent=16),
    "weighted": lambda: store("codebook-4k-3v-n8", center="k", key_scale="q", first=4),
    "window": lambda: KVStore(Codebook(4), window=40, keep=4, page_size=16),
    "plain-values": lambda: store("codebook-3k-plain-v", first=16),
}


def written(kind, length=150, attended=True):
    s = KINDS[kind]()
    keys, values, queries = skewed(length, seed=1)
    for a, b in ((0, length - 10), (length - 10, length)):
        mask = s.make_mask(b - a)
        s.update_and_fetch(keys[:, :, a:b], values[:, :, a:b])
        if attended:
            attend(s, queries[:, :, a:b], mask)
    return s


@pytest.mark.parametrize("kind", list(KINDS))
def test_state_round_trip(kind):
    s = written(kind)
    loaded = KVStore.from_state(s.state)
    assert loaded.settings == s.settings and loaded.nbytes == s.nbytes
    assert (loaded.offset, loaded.size(), loaded.dropped) == (
        s.offset,
        s.size(),
        s.dropped,
    )
    same_storage(loaded, s)
    for a, b in zip(loaded.transform.arrays(), s.transform.arrays()):
        assert (a is None) == (b is None) and (a is None or mx.array_equal(a, b))
    # later writes and reads are alike
    keys, values, queries = skewed(3, seed=2)
    outs = []
    for c in (s, loaded):
        mask = c.make_mask(3)
        c.update_and_fetch(keys, values)
        outs.append(attend(c, queries, mask))
    assert mx.array_equal(*outs)


def test_state_of_an_empty_store_and_of_a_pending_write():
    empty = KVStore.from_state(store(center="k", key_scale="qk", first=4).state)
    assert empty.empty() and empty.transform.key_weights is None
    # a write completing the first tokens, waiting for its queries, is written
    # with weights of ones (no queries seen)
    pending = written("weighted", 30, attended=False)
    loaded = KVStore.from_state(pending.state)
    assert (loaded.transform.key_weights == 1).all().item() and loaded.offset == 30
    # a store short of its first tokens: no transform yet, in the state too
    short = store("codebook-4k-3v-n8", center="k", key_scale="q", first=8)
    keys, values, queries = skewed(5, seed=3)
    short.update_and_fetch(keys, values)
    attend(short, queries, "causal")
    loaded = KVStore.from_state(short.state)
    assert not loaded.transform.fixed and loaded.transform.arrays() == (None,) * 3
    same_storage(loaded, short)
    assert mx.array_equal(loaded.spans.first_keys, short.spans.first_keys)
    # (the queries seen are not in a state: the loaded store fixes the
    # transform with the queries it sees)
    more = skewed(10, seed=4)
    for c in (short, loaded):
        c.update_and_fetch(*more[:2])
        attend(c, more[2], "causal")
    assert loaded.transform.fixed and short.transform.fixed


ROWS = slice(9, 14)  # offset, rows written (held included), in the pages, dropped, held
NAMES = ["key_pages", "value_pages", "first_keys", "first_values"]
NAMES += ["held_keys", "held_values", "key_mean", "value_mean", "key_weights"]
NAMES += ["offset", "idx", "written", "dropped", "held", "settings"]


def changed(state, **items):
    state = list(state)
    for name, value in items.items():
        state[NAMES.index(name)] = value
    return state


def bad_states(s):
    state = s.state
    settings = json.loads(state[-1])
    pages = state[0]
    mean = state[NAMES.index("key_mean")]
    return {
        "not JSON": changed(state, settings="{keys: 3"),
        "unknown setting": changed(state, settings=json.dumps({**settings, "bits": 3})),
        "short": state[:-3] + state[-1:],
        "codec parts": changed(
            state, settings=json.dumps({**settings, "keys": "affine-4-64-none"})
        ),
        "codec spec": changed(
            state, settings=json.dumps({**settings, "keys": "codebook-3-twirl-dot"})
        ),
        "page counts": changed(state, value_pages=state[1][:1]),
        "row counts": changed(state, idx=state[10] - 1),
        "dropped past written": changed(state, dropped=state[11] + 1),
        "more rows than pages": changed(
            state, offset=10_000, idx=10_000, written=10_000
        ),
        "kept keys alone": changed(state, first_values=None),
        "held tokens missing": changed(state, held=3, idx=state[10] + 3),
        "value mean with center=k": changed(state, value_mean=mean),
        "mean of one head": changed(state, key_mean=mean[:, :1]),
        "mean with centering off": changed(
            state, settings=json.dumps({**settings, "center": ""})
        ),
        "weights with key_scale off": changed(state, key_weights=mx.ones_like(mean)),
        "first span of other length": changed(
            state, settings=json.dumps({**settings, "first": 2})
        ),
        "pages of other heads": changed(
            state, key_pages=[[x[:, :1] for x in page] for page in pages]
        ),
    }


def centered_store():
    s = KVStore(3, 4, page_size=PAGE, center="k", first=4)
    fill(s, 2, 150, 1, 64)  # three pages
    return s


@pytest.mark.parametrize("bad", list(bad_states(centered_store())))
def test_inconsistent_states_are_refused_whole(bad):
    s = centered_store()
    state = bad_states(s)[bad]
    with pytest.raises(ValueError):
        KVStore.from_state(state)
    before = (s.settings, s.offset, s._written, len(s.key_pages), s.nbytes)
    with pytest.raises(ValueError):
        s.state = state
    # a refused state leaves the store as it was
    assert (s.settings, s.offset, s._written, len(s.key_pages), s.nbytes) == before
    queries = mx.random.normal((1, 4, 1, 64))
    assert relative_error(attend(s, queries, None), reference(s, queries, None)) < 1e-4


def test_a_batch_state_round_trips_and_refuses_bad_rows():
    batch = KVStore.merge(singles([5, 0, 70], first=4, center="k"))
    loaded = BatchKVStore.from_state(batch.state)
    assert isinstance(loaded, BatchKVStore)
    assert loaded.left_padding.tolist() == [65, 70, 0]
    assert loaded.offset.tolist() == [5, 0, 70]
    same_storage(loaded, batch)
    state = changed(batch.state, idx=71)
    with pytest.raises(ValueError, match="row counts"):
        batch.state = state
    assert batch._idx == 70


# ---------------------------------------------------------------------------
# Trim and reserve


def test_trim_then_write():
    s = KVStore(3, page_size=PAGE)
    fill(s, 1, 90, 90, 64)
    assert s.is_trimmable() and s.trim(40) == 40
    fill(s, 1, 30, 30, 64)
    assert (s.size(), s.capacity) == (80, 128)
    queries = mx.random.normal((1, 4, 30, 64))
    assert (
        relative_error(attend(s, queries, "causal"), reference(s, queries, "causal"))
        < 1e-4
    )
    assert s.trim(1000) == 80 and s.offset == 0 and not s.empty()


def test_reserve_makes_the_first_page_hold_the_generation():
    s = KVStore(Affine(8), Affine(4), page_size=16)
    s.reserve = 100
    fill(s, 1, 90, 90, 64)
    s.trim(40)
    fill(s, 1, 30, 30, 64)
    # rounded up to 16 rows: the kernels' tiles stay in a page
    assert (s.offset, s.capacity, len(s.key_pages)) == (80, 112, 1)
    queries = mx.random.normal((1, 4, 30, 64))
    assert (
        relative_error(attend(s, queries, "causal"), reference(s, queries, "causal"))
        < 1e-4
    )


def test_generate_step_feeds_and_reserves(model):
    prompt = list(range(3, 40))
    caches = [KVStore(3, 4, page_size=16) for _ in model.layers]
    steps = generate_step(mx.array(prompt), model, max_tokens=12, prompt_cache=caches)
    tokens = [int(t) for t, _ in steps]
    assert len(tokens) == 12 and all(0 <= t < CONFIG["vocab_size"] for t in tokens)
    # generate_step feeds each token as it yields it
    assert caches[0].offset == len(prompt) + len(tokens)
    # and reserves the whole generation: one page of the prompt and max_tokens
    assert caches[0].reserve == len(prompt) + 12
    assert [p[0].shape[2] for p in caches[0].key_pages] == [64]
    # lossless values and 4-bit keys stay close to the model's own caches
    near = [KVStore(4, Plain()) for _ in model.layers]
    exact = [KVCache() for _ in model.layers]
    tokens = [
        [
            int(t)
            for t, _ in generate_step(
                mx.array(prompt), model, max_tokens=12, prompt_cache=caches
            )
        ]
        for caches in (near, exact)
    ]
    assert sum(a == b for a, b in zip(*tokens)) >= 6


# ---------------------------------------------------------------------------
# Batches


def singles(lengths, codecs=(3, 4), dim=64, seed=0, **settings):
    mx.random.seed(seed)
    out = []
    for n in lengths:
        s = KVStore(*codecs, page_size=PAGE, **settings)
        if n:
            fill(s, 2, n, n, dim)
        out.append(s)
    return out


def batch_step(batch, stores, seed):
    """One decode token through the batch and through each store alone: the
    batch's outputs and each alone's."""
    mx.random.seed(seed)
    B = len(stores)
    keys, values = random_kv(B, 2, 1, 64)
    queries = mx.random.normal((B, 6, 1, 64)) * 3
    mask = batch.make_mask(1)
    batch.update_and_fetch(keys, values)
    out = attend(batch, queries, mask)
    alone = []
    for i, s in enumerate(stores):
        mask = s.make_mask(1)
        s.update_and_fetch(keys[i : i + 1], values[i : i + 1])
        alone.append(attend(s, queries[i : i + 1], mask))
    return out, alone


@pytest.mark.parametrize(
    "settings",
    [{}, {"first": 4, "center": "k"}, {"center": "kv", "first": 16}],
    ids=["plain", "first-center", "first16-center-kv"],
)
def test_merge_and_extract_round_trip(settings):
    stores = singles([5, 0, 70], **settings)
    batch = KVStore.merge(stores)
    assert isinstance(batch, BatchKVStore)
    assert batch.left_padding.tolist() == [65, 70, 0]
    assert batch.offset.tolist() == [5, 0, 70] and batch.size() == 70
    for i in (0, 2):
        single = batch.extract(i)
        assert type(single) is KVStore and single.offset == stores[i].offset
        assert single.settings == stores[i].settings
        same_storage(single, stores[i])
        for a, b in zip(
            (single.spans.first_keys, single.spans.first_values),
            (stores[i].spans.first_keys, stores[i].spans.first_values),
        ):
            assert (a is None) == (b is None) and (a is None or mx.array_equal(a, b))
        # a store short of its first tokens has no transform yet: joined to
        # fixed ones, it gets none for good (zero means)
        for a, b in zip(single.transform.arrays(), stores[i].transform.arrays()):
            if b is None and a is not None:
                assert stores[i].offset < settings.get("first", 0) and not a.any()
            else:
                assert (a is None) == (b is None)
                assert a is None or mx.array_equal(a, b)
    out, alone = batch_step(batch, stores, 1)
    for i, want in enumerate(alone):
        assert relative_error(out[i : i + 1], want) < 1e-4
    with pytest.raises(ValueError, match="different settings"):
        KVStore.merge([stores[0], KVStore(4, 4, page_size=PAGE, **settings)])


@pytest.mark.parametrize(
    "q4",
    [
        (Affine(4, 64, "hadamard"), Affine(3, 32, "hadamard")),
        (Affine(4, 32, "hadamard", "int"), Affine(4, 32, "hadamard", "int")),
    ],
    ids=["float", "int"],
)
def test_a_batch_keeps_a_residuals_held_tokens(q4):
    """Merged, a residual's held tokens stay held (rows one store holds and
    another has in its pages: decoded, as attention reads them); the batch
    attends as its stores alone, and extends and extracts as they are."""
    settings = {"center": "k", "key_scale": "qk", "first": 8, "recent": 16}
    stores = singles([5, 0, 37, 70], codecs=q4, **settings)
    for s in stores:
        s.keys_and_values()  # a read: the pending writes written
    assert [(s._written, s.spans.n_held) for s in stores] == [
        (0, 5),
        (0, 0),
        (16, 21),
        (48, 22),
    ]
    batch = KVStore.merge(stores)
    assert (batch._written, batch.spans.n_held, batch.size()) == (48, 22, 70)
    single = batch.extract(3)
    same_storage(single, stores[3])
    assert single.spans.n_held == 22
    assert mx.array_equal(single.spans.held_keys, stores[3].spans.held_keys)
    for seed in range(3):
        out, alone = batch_step(batch, stores, seed)
        for i, want in enumerate(alone):
            assert relative_error(out[i : i + 1], want) < 1e-4
    others = singles([12], codecs=q4, seed=1, **settings)
    batch.extend(KVStore.merge(others))
    assert batch.spans.n_held == batch.size() - batch._written
    out, alone = batch_step(batch, [*stores, *others], 9)
    for i, want in enumerate(alone):
        assert relative_error(out[i : i + 1], want) < 1e-4


@pytest.mark.parametrize(
    "lengths,settings",
    [
        ((17, 3), {"first": 16}),
        ((16, 40, 2), {"first": 16, "center": "kv"}),
        # a residual: rows the batch holds that a store has in its first span
        ((17, 12, 40), {"first": 8, "recent": 8}),
        ((17, 12, 40), {"first": 8, "recent": 8, "center": "k", "key_scale": "q"}),
    ],
)
def test_merged_stores_put_zeros_where_a_store_has_only_its_first_span(
    lengths, settings
):
    """A batch's pages hold every row (a window's dropped ones aside): where
    a store holds its first tokens in the first span only, zeros, which
    attention hides (it reads the first span); rows the batch holds as
    recent ones come from the first span. Lossless codecs: each sequence
    attends as float32 attention over its keys and values as they came,
    through decode steps; extracted, a sequence's store is laid out as it
    was."""
    keys, values = random_kv(len(lengths), 2, 60, 64, seed=7, offset=2)
    stores = []
    for i, n in enumerate(lengths):
        s = KVStore(Plain(), Plain(), page_size=PAGE, **settings)
        s.update_and_fetch(keys[i : i + 1, :, :n], values[i : i + 1, :, :n])
        attend(s, mx.random.normal((1, 4, n, 64)), "causal")
        stores.append(s)
    batch = KVStore.merge(stores)
    assert batch.dropped == 0
    longest = lengths.index(max(lengths))
    assert mx.array_equal(
        batch.extract(longest).spans.first_keys, stores[longest].spans.first_keys
    )
    for i, n in enumerate(lengths):
        # (a residual's batch may hold rows its store had written)
        single = batch.extract(i)
        assert single.dropped == min(settings["first"], single._written)
        assert single._written + single.spans.n_held == n
    for t in range(4):
        step = [
            mx.concatenate(
                [x[i : i + 1, :, n + t : n + t + 1] for i, n in enumerate(lengths)]
            )
            for x in (keys, values)
        ]
        queries = mx.random.normal((len(lengths), 4, 1, 64))
        mask = batch.make_mask(1)
        batch.update_and_fetch(*step)
        out = attend(batch, queries, mask)
        for i, n in enumerate(lengths):
            rows = slice(0, n + t + 1)
            want = float_attention(
                queries[i : i + 1], keys[i : i + 1, :, rows], values[i : i + 1, :, rows]
            )
            assert relative_error(out[i : i + 1], want) < 1e-5, (t, i)


def test_a_debiased_batch_attends_as_its_stores_alone():
    stores = singles([5, 37, 70], codecs=(Codebook(3, debias=True), 4))
    batch = KVStore.merge(stores)
    assert batch.key_codec.debias
    out, alone = batch_step(batch, stores, 4)
    for i, want in enumerate(alone):
        assert relative_error(out[i : i + 1], want) < 1e-4


def test_filter_and_extend_track_the_stores_alone():
    stores = singles([5, 37, 70], first=4, center="k")
    batch = KVStore.merge(stores)
    batch.filter([0, 1])  # drops 33 rows of shared padding
    assert batch.left_padding.tolist() == [32, 0] and batch.size() == 37
    assert batch.padding() == (32, 0)  # read once, kept until it changes
    assert batch.transform.key_mean.shape[0] == 2
    others = singles([12, 100], seed=1, first=4, center="k")
    batch.extend(KVStore.merge(others))
    assert batch.padding() == (95, 63, 88, 0)
    assert batch.offset.tolist() == [5, 37, 12, 100] and batch.size() == 100
    kept = [stores[0], stores[1], *others]
    for i in range(4):
        same_storage(batch.extract(i), kept[i])
    out, alone = batch_step(batch, kept, 2)
    for i, want in enumerate(alone):
        assert relative_error(out[i : i + 1], want) < 1e-4
    # empty batches extend by offsets and padding only
    empty = BatchKVStore([1, 2], 3, 4)
    empty.extend(BatchKVStore([0], 3, 4))
    assert empty.empty() and empty.left_padding.tolist() == [1, 2, 0]
    with pytest.raises(ValueError, match="different settings"):
        empty.extend(BatchKVStore([0], 3, 3))


@pytest.mark.parametrize("length", [40, 70])
def test_filter_leaves_padding_a_residual_holds(length):
    """The server's filter after a long answer ends: the shared left padding
    of the sequences left runs past the rows the pages hold (a residual
    holds the rest); the pages' rows go, the held ones stay, masked; each
    sequence attends as alone."""
    mx.random.seed(0)
    stores = [KVStore(3, 4, recent=8, page_size=16) for _ in range(2)]
    for s, n in zip(stores, (length, 3)):
        fill(s, 2, n, n, 64)
    batch = KVStore.merge(stores)
    assert batch._written < length - 3  # padding in the residual
    batch.filter([1])
    assert batch.size() <= length and batch.offset.tolist() == [3]
    for seed in (2, 3):
        out, (alone,) = batch_step(batch, [stores[1]], seed)
        assert relative_error(out, alone) < 1e-4


@pytest.mark.parametrize("codecs", [(3, 4), (Affine(4, 64, "hadamard"), Affine(8))])
@pytest.mark.parametrize("n", [0, 3])
def test_a_batch_tracks_mlx_lms_batch_cache(n, codecs):
    """Fed the same keys and values, each sequence's first ``n`` as they
    came and the rest rounded through the codecs, a ``BatchKVCache`` attends
    as the batch store through prefill with right padding, decode, filter
    and extend."""

    def step(pair, t, B):
        k, v = mx.random.normal((2, B, 2, t, 64))
        q = mx.random.normal((B, 4, t, 64))
        plain, coded = pair
        mask = plain.make_mask(t)
        assert mx.array_equal(mask, coded.make_mask(t))
        token = coded._idx + mx.arange(t)[None] - coded.left_padding[:, None]
        first = ((token >= 0) & (token < n))[:, None, :, None]
        fk = mx.where(first, k, codec_round(coded.key_codec, k))
        fv = mx.where(first, v, codec_round(coded.value_codec, v))
        fk, fv = plain.update_and_fetch(fk, fv)
        coded.update_and_fetch(k, v)
        out = float_attention(q, fk, fv, mask)
        cout = attend(coded, q, mask)
        # queries that see no key (left padding) have no defined output
        seen = mask.any(axis=-1, keepdims=True)
        out, cout = mx.where(seen, out, 0), mx.where(seen, cout, 0)
        assert mx.allclose(out, cout, rtol=1e-4, atol=1e-4)
        assert mx.array_equal(plain.offset, coded.offset)

    def pair(padding):
        coded = BatchKVStore(padding, *codecs, page_size=8, first=n)
        return BatchKVCache(padding), coded

    mx.random.seed(8)
    a = pair([2, 0, 5])
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
    b = pair([1, 0])
    step(b, 2, 2)  # the first sequence's first tokens are not all written yet
    step(b, 2, 2)
    for c, other in zip(a, b):
        c.extend(other)
    for _ in range(3):
        step(a, 1, 4)
    assert a[1].size() == a[0]._idx
    if n:
        assert a[1].extract(2).spans.first_keys.shape[2] == n


@pytest.mark.parametrize(
    "settings",
    [{"recent": 8}, {"recent": 8, "first": 4, "center": "k", "key_scale": "qk"}],
    ids=["residual", "residual-first-center"],
)
def test_a_right_padded_prefill_keeps_each_sequences_recent_tokens(settings):
    """The server prefills right-padded prompts: a short prompt's rows go to
    the pages with the long one's old rows, then ``finalize`` moves them to
    the end. Each sequence's last tokens are held as they came, as alone
    (4-bit codecs: a decoded row would show): through decode, each attends
    as its store alone."""
    codecs = (Affine(4, 64, "hadamard"), Affine(4, 64, "hadamard"))
    lengths = [6, 40, 24]
    T = max(lengths)
    keys, values = random_kv(3, 2, T + 3, 64, seed=5, offset=2)
    queries = mx.random.normal((3, 4, T, 64))
    batch = BatchKVStore([0, 0, 0], *codecs, page_size=PAGE, **settings)
    batch.prepare(lengths=lengths, right_padding=[T - n for n in lengths])
    mask = batch.make_mask(T, return_array=True)
    batch.update_and_fetch(keys[:, :, :T], values[:, :, :T])
    attend(batch, queries, mask)
    batch.finalize()
    stores = []
    for i, n in enumerate(lengths):
        s = KVStore(*codecs, page_size=PAGE, **settings)
        s.update_and_fetch(keys[i : i + 1, :, :n], values[i : i + 1, :, :n])
        attend(s, queries[i : i + 1, :, :n], "causal")
        stores.append(s)
    for t in range(3):
        q = mx.random.normal((3, 4, 1, 64))
        mask = batch.make_mask(1)
        step = [
            mx.concatenate(
                [x[i : i + 1, :, n + t : n + t + 1] for i, n in enumerate(lengths)]
            )
            for x in (keys, values)
        ]
        batch.update_and_fetch(*step)
        out = attend(batch, q, mask)
        for i, s in enumerate(stores):
            s.update_and_fetch(step[0][i : i + 1], step[1][i : i + 1])
            want = attend(s, q[i : i + 1], None)
            assert relative_error(out[i : i + 1], want) < 1e-4, (t, i)


def test_right_padding_is_left_out_of_the_transform():
    # first=8: the second prompt has 5 tokens, then right padding
    keys, values, queries = skewed(12, seed=9, batch=2)
    batch = BatchKVStore([0, 0], 4, center="k", key_scale="q", first=8)
    batch.prepare(lengths=[12, 5], right_padding=[0, 7])
    mask = batch.make_mask(12)
    batch.update_and_fetch(keys, values)
    attend(batch, queries, mask)
    t = batch.transform
    for i, n in enumerate((8, 5)):
        expected = keys[i, :, 1:n].mean(axis=1, keepdims=True)
        assert mx.allclose(t.key_mean[i], expected, atol=1e-5)
        weights = first_weights(keys[i : i + 1], queries[i : i + 1], n, "q", "k")
        assert mx.allclose(t.key_weights[i], weights[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "settings",
    [{"center": "kv"}, {"center": "k", "key_scale": "qk"}, {"key_scale": "q"}],
    ids=["kv", "k-qk", "q"],
)
def test_a_batch_of_unequal_padding_fixes_its_transform_before_a_later_row(settings):
    """Left padding 0 and 6, first=4, token by token: the least padded
    sequence's rows after its first tokens go to the pages from row 4 on,
    while the other has none of its first tokens yet. The transform is fixed
    before the first of them is written (the other sequence's from the
    first tokens it has then: none, no transform): lossless codecs attend as
    float32 attention over the keys and values as they came."""
    keys, values = random_kv(2, 2, 20, 64, seed=1, offset=4)
    batch = BatchKVStore([0, 6], Plain(), Plain(), first=4, **settings)
    for t in range(20):
        queries = mx.random.normal((2, 4, 1, 64))
        mask = batch.make_mask(1, return_array=True)
        batch.update_and_fetch(keys[:, :, t : t + 1], values[:, :, t : t + 1])
        out = attend(batch, queries, mask)
        assert batch.transform.fixed == (t >= 4), t
        for i, pad in enumerate((0, 6)):
            if t < pad:
                continue
            rows = slice(pad, t + 1)
            want = float_attention(
                queries[i : i + 1], keys[i : i + 1, :, rows], values[i : i + 1, :, rows]
            )
            assert relative_error(out[i : i + 1], want) < 1e-5, (t, i)
    # the second sequence had no token when the transform was fixed
    t = batch.transform
    if t.center:
        assert not t.key_mean[1].any() and t.key_mean[0].any()
    if t.key_scale:
        assert mx.allclose(t.key_weights[1], mx.ones_like(t.key_weights[1]))


def test_joined_transforms_give_the_unfixed_no_transform():
    """Sequences laid end to end: a part whose transform is not fixed yet
    gets zero means and unit weights when another part's is fixed (no
    transform, for good); unfixed when none is."""
    fixed = Transform("kv", "qk", *(mx.full((2, 2, 1, 8), 3.0) for _ in range(3)))
    joined = Transform.joined([Transform("kv", "qk"), fixed], [1, 2])
    assert joined.fixed and joined.key_mean.shape == (3, 2, 1, 8)
    assert not joined.key_mean[0].any() and not joined.value_mean[0].any()
    assert (joined.key_weights[0] == 1).all().item()
    assert (joined.key_weights[1:] == 3).all().item()
    unfixed = Transform.joined([Transform("k", "q"), Transform("k", "q")], [1, 1])
    assert not unfixed.fixed and unfixed.arrays() == (None,) * 3
    with pytest.raises(ValueError, match="different transforms"):
        Transform.joined([Transform("k"), Transform("kv")], [1, 1])


@pytest.mark.parametrize("center", ["", "k", "kv"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_one_op_transform_and_rotation_equal_the_steps(center, dtype):
    """``Transform.rotated`` (a matmul with the weights and the rotation in
    one matrix, the mean in its shift) and ``query_scale`` (the weights'
    reciprocals, kept) give what centering, weighting and rotating step by
    step give, within the dtype's rounding."""
    D = 64
    keys, values = (
        mx.random.normal((2, 2, 5, D), key=mx.random.key(i)) + 2 for i in (1, 2)
    )
    weights = mx.exp(mx.random.normal((2, 2, 1, D), key=mx.random.key(3)) / 2)
    t = Transform(center, "qk")
    t.key_mean = keys.mean(axis=2, keepdims=True) if center else None
    t.value_mean = values.mean(axis=2, keepdims=True) if center == "kv" else None
    t.key_weights = weights
    keys, values = keys.astype(dtype), values.astype(dtype)
    want = (rotate(x.astype(mx.float32), "hadamard") for x in t(keys, values))
    tol = 1e-5 if dtype == mx.float32 else 1e-2
    for got, ref in zip(t.rotated(keys, values), want):
        assert got.dtype == dtype and relative_error(got, ref) < tol
    queries = mx.random.normal((2, 6, 3, D), key=mx.random.key(4)).astype(dtype)
    scale = t.query_scale(dtype, 6)
    assert scale is t.query_scale(dtype, 6)  # made once
    ref = queries.astype(mx.float32) / mx.repeat(weights, 3, axis=1)
    assert relative_error(queries * scale, ref) < tol


@pytest.mark.parametrize("center", ["k", "kv"])
def test_merged_stores_short_of_their_first_tokens_fix_it_together(center):
    """Stores of 3 and 5 tokens (first=8: no transform yet) merged, then
    decode tokens: the batch fixes its transform with the write that puts
    the first row after a sequence's first tokens in the pages (each
    sequence's from the first tokens it has then); lossless codecs attend
    as float32 attention over the keys and values as they came."""
    keys, values = random_kv(2, 2, 20, 64, seed=3, offset=4)
    lengths = (3, 5)
    stores = []
    for i, n in enumerate(lengths):
        s = KVStore(Plain(), Plain(), center=center, first=8)
        s.update_and_fetch(keys[i : i + 1, :, :n], values[i : i + 1, :, :n])
        stores.append(s)
    batch = KVStore.merge(stores)
    assert not batch.transform.fixed and batch.left_padding.tolist() == [2, 0]
    for t in range(5, 15):
        step = [
            mx.concatenate([x[:1, :, t - 2 : t - 1], x[1:, :, t : t + 1]])
            for x in (keys, values)
        ]
        queries = mx.random.normal((2, 4, 1, 64))
        mask = batch.make_mask(1)
        batch.update_and_fetch(*step)
        out = attend(batch, queries, mask)
        # the second sequence's 9th token (row 8) is the first after its first
        assert batch.transform.fixed == (t >= 8), t
        for i, n in enumerate((t - 1, t + 1)):
            want = float_attention(
                queries[i : i + 1], keys[i : i + 1, :, :n], values[i : i + 1, :, :n]
            )
            assert relative_error(out[i : i + 1], want) < 1e-5, (t, i)
    # the first sequence's mean: of the 7 tokens it had (1 to 6)
    mean = keys[:1, :, 1:7].mean(axis=2, keepdims=True)
    assert mx.allclose(batch.transform.key_mean[:1], mean, atol=1e-5)


def test_left_padding_is_added_to_an_empty_batch_only():
    batch = BatchKVStore([0, 1], 4)
    batch.prepare(left_padding=[2, 0])
    assert batch.left_padding.tolist() == [2, 1]
    batch.update_and_fetch(*random_kv(2, 2, 5, 64))
    with pytest.raises(ValueError, match="empty cache"):
        batch.prepare(left_padding=[1, 1])


def windowed(lengths, window=24, seed=0):
    mx.random.seed(seed)
    out = []
    for n in lengths:
        s = KVStore(Codebook(4), window=window, keep=4, page_size=8)
        keys, values = random_kv(1, 2, n, 64)
        for a in range(0, n, 10):
            s.update_and_fetch(keys[:, :, a : a + 10], values[:, :, a : a + 10])
        out.append(s)
    return out


def test_windowed_batches_with_dropped_pages():
    stores = windowed([90, 30, 7])
    # the sinks (rows 0-3) in the first span only, then pages of 8 rows
    assert [s.dropped for s in stores] == [4 + 56, 4, 4]
    batch = KVStore.merge(stores)
    # the rows none of its sequences holds: the first's dropped ones (the
    # others' padding covers them)
    assert batch.window == 24 and batch.dropped == 60
    assert batch.offset.tolist() == [90, 30, 7]
    assert batch.left_padding.tolist() == [0, 60, 83]
    for _ in range(3):
        out, alone = batch_step(batch, stores, 5)
        for i, want in enumerate(alone):
            assert relative_error(out[i : i + 1], want) < 1e-4
    single = batch.extract(1)
    assert single.offset == 33 and single.window == 24
    others = windowed([50], seed=1)
    batch.filter([0, 2])
    batch.extend(KVStore.merge(others))
    kept = [stores[0], stores[2], *others]
    out, alone = batch_step(batch, kept, 6)
    for i, want in enumerate(alone):
        assert relative_error(out[i : i + 1], want) < 1e-4


def assert_batch_generator_matches_single_generation(model, prompts, caches, **batch):
    """Six greedy tokens a prompt through ``BatchGenerator`` (``batch``: its
    batch sizes), each prompt's caches from ``caches()``, equal those of the
    prompt alone through ``generate_step``."""
    gen = BatchGenerator(model, max_tokens=6, completion_batch_size=3, **batch)
    uids = gen.insert(prompts, caches=[caches() for _ in prompts])
    tokens = {uid: [] for uid in uids}
    while responses := gen.next_generated():
        for r in responses:
            tokens[r.uid].append(r.token)
    for uid, prompt in zip(uids, prompts):
        steps = generate_step(
            mx.array(prompt), model, max_tokens=6, prompt_cache=caches()
        )
        assert tokens[uid] == [int(t) for t, _ in steps]


def test_batch_generator_matches_single_generation(model):
    prompts = [list(range(3, 30)), [5, 6, 7], list(range(40, 52))]

    def caches():
        return [
            KVStore(Codebook(4), 3, center="k", first=4, key_scale="q")
            for _ in model.layers
        ]

    assert_batch_generator_matches_single_generation(
        model, prompts, caches, prefill_batch_size=2
    )


def test_batched_decode_makes_the_first_tokens_masks_once_a_step(model, monkeypatch):
    """A decode step's layers attend with one mask and the same first
    tokens: the MLX-ops loop makes their masks once for all of them."""
    made = []
    first_masks = attention._first_masks

    def counted(mask, first, length, end, heads):
        if heads[0] == 1 and not isinstance(first.first, int):  # batched decode
            made.append((length, end))
        return first_masks(mask, first, length, end, heads)

    monkeypatch.setattr(attention, "_first_masks", counted)
    prompts = [list(range(3, 30)), [5, 6, 7, 8, 9, 10], list(range(40, 52))]

    def caches():
        return [
            KVStore(Affine(4), center="k", first=4, key_scale="qk")
            for _ in model.layers
        ]

    assert_batch_generator_matches_single_generation(model, prompts, caches)
    assert len(model.layers) > 1 and len(made) >= 4
    assert len(set(made)) == len(made)


# ---------------------------------------------------------------------------
# Chunked prefill on the real SmolLM2 (float32)

SCHEMES = [
    "cq4",
    "q4",
    "q4-recall",
    "bits=8",
    "bits=4 center=none qscale=none",
    "bits=8,4",
]
# schemes with a transform (centering, key weights): fixed from the first
# tokens and the queries at their positions, summed call by call
TRANSFORMED = ("cq4", "q4", "q4-recall")


def replay(s, keys, values, queries, scale, cuts):
    """A recorded layer's prefill through ``s``, chunk by chunk (``cuts``:
    the chunks' ends); the outputs of every query."""
    outs, start = [], 0
    for stop in cuts:
        mask = s.make_mask(stop - start)
        s.update_and_fetch(keys[:, :, start:stop], values[:, :, start:stop])
        outs.append(attend(s, queries[:, :, start:stop], mask, scale=scale))
        start = stop
    return mx.concatenate(outs, axis=2)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_real_layers_prefill_in_chunks(smollm2_f32, smollm2_prefill, scheme):
    """SmolLM2's recorded keys, values and queries (layers 0, 1, 12 and 29)
    through a scheme's store in one chunk and in the other ways of
    ``kv_model_runs.ways``. Split where the first tokens end or later, or
    the prompt but its last token then that token: the same outputs as one
    chunk (measured: equal). Token by token and split inside the first
    tokens: the same without a transform (measured: equal); with one, the
    queries' energies are summed call by call, in another order: within
    1e-4 (measured: up to 6.7e-6)."""
    from kv_model_runs import spec_of, ways

    model = smollm2_f32[0]
    spec = spec_of(scheme)
    T = smollm2_prefill[0][0].shape[2]
    equal, near = ways(spec.first_tokens, T)
    for layer in (0, 1, 12, 29):
        keys, values, queries, scale = smollm2_prefill[layer]
        outs = {}
        for way, cuts in {**equal, **near}.items():
            s = spec.make_cache(model)[layer]
            outs[way] = replay(s, keys, values, queries, scale, cuts)
            assert s.offset == T and s.transform.fixed
        for way, out in outs.items():
            bound = 1e-4 if way in near and scheme in TRANSFORMED else 1e-6
            assert mx.abs(out - outs["one"]).max().item() <= bound, (layer, way)


@pytest.fixture(scope="module")
def chunk_runs(smollm2_dirs):
    """``kv_model_runs.chunk_runs`` of every scheme, in a process of its own
    with the reference BLAS that MLX's CPU wheel bundles (LD_PRELOAD left
    out): it computes each row of a product alike whatever the rows with
    it, Debian's OpenBLAS does not (measured: 3e-5 apart in q4's logits
    after a split, up to 1.0 in cq4's once a code flips), though it is
    2-3x faster."""
    import os
    import subprocess
    import sys

    import kv_model_runs

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    run = [sys.executable, kv_model_runs.__file__, str(smollm2_dirs[1]), *SCHEMES]
    printed = subprocess.run(run, capture_output=True, text=True, env=env, check=True)
    return json.loads(printed.stdout)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_real_model_logits_unchanged_through_chunks(chunk_runs, scheme):
    """The whole SmolLM2 (float32, on the CPU) prefills a 33-token prompt in
    one chunk and in the other ways of ``kv_model_runs.ways``, then takes
    two greedy tokens. Every way gives the model's own greedy tokens (fp16
    caches: top-1 margin 7.6 logits) and last logits within KL 0.02 nats of
    fp16's (measured: up to 0.0011).

    - Split where the first tokens end (or at 20 without any), or the
      prompt but its last token then that token: the transform is fixed
      from the same first tokens and queries, every token stored alike:
      one chunk's logits after the prompt and at each greedy step (max
      absolute difference 1e-5; measured: equal).
    - Token by token, split inside the first tokens and just before their
      end: the same without a transform (measured: equal). With one, the
      queries' energies are summed call by call: float rounding, in the
      layers before too, which flips codes at their cells' edges: the same
      greedy tokens, logits within 3 (absolute) and 0.15 (relative L2) of
      one chunk's (measured: up to 1.76 and 0.077, q4-recall token by
      token; cq4 0.77 and 0.022 split inside), q4's (every token held
      unquantized) within 1e-3 (measured: 6.3e-5) and 1e-5 of fp16's
      (relative L2; measured: 2e-6)."""
    runs = chunk_runs[scheme]
    assert chunk_runs["tokens"] == 33 and chunk_runs["fp16"]["margin"] > 5
    assert runs["equal"] == ["one", "split", "prefix"]
    near = {"tokens", "inside", "before_first"} if runs["first"] > 4 else {"tokens"}
    assert set(runs["near"]) == near
    for way in runs["equal"] + runs["near"]:
        run = runs[way]
        assert run["greedy"] == chunk_runs["fp16"]["greedy"], way
        assert run["kl"] < 0.02, way
        if way in runs["equal"] or scheme not in TRANSFORMED:
            assert run["max_abs"] <= 1e-5 and run["decode_max_abs"] <= 1e-5, way
        elif scheme == "q4":
            assert run["max_abs"] <= 1e-3, way
        else:
            assert run["max_abs"] <= 3 and run["vs_one"] <= 0.15, way
    if scheme == "q4":
        assert all(runs[way]["vs_fp16"] < 1e-5 for way in runs["equal"] + runs["near"])


def test_bytes_per_token_is_what_a_token_takes_in_the_pages():
    """What the server's KV cache budget counts (``mlx_lm.server``'s
    ``kv_bytes_per_token``): a token's codes, scales and biases, per
    sequence, whatever the page size and the first tokens kept."""
    from mlx_lm.server import kv_bytes_per_token

    s = KVStore(Affine(8), Affine(4), first=16)
    assert s.bytes_per_token is None
    s.update_and_fetch(*random_kv(1, 2, 100, 64, seed=1))
    # 2 heads: 8-bit keys 64 bytes, 4-bit values 32, each a float32 scale
    # and bias a group of 64
    assert s.bytes_per_token == 2 * (64 + 32 + 2 * 2 * 4)
    batch = BatchKVStore([0, 3], Affine(8), Affine(4))
    batch.update_and_fetch(*random_kv(2, 2, 20, 64, seed=2))
    assert batch.bytes_per_token == s.bytes_per_token
    model = make_model()
    spec = KVSpec.parse("bits=8,4")
    per_token = kv_bytes_per_token(model, spec.make_cache(model))
    layers, heads, dim = (
        CONFIG[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")
    )
    groups = 2 * dim // 64  # keys' and values' groups of 64
    assert per_token == layers * heads * (dim + dim // 2 + groups * 2 * 4)
