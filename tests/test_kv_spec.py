"""The scheme language (``omlx_cache.kv.spec``): parsing and printing, the
errors it gives, its defaults, the footprint against what stores hold after
a real prefill, and the caches it makes for real models."""

import mlx.core as mx
import pytest
from kv_helpers import random_kv
from mlx_lm.models.cache import KVCache, RotatingKVCache

from omlx_cache.kv import Affine, Codebook, KVStore, Plain
from omlx_cache.kv.spec import (
    AVERAGE_CONTEXT,
    PRESETS,
    KVSpec,
    LayerShape,
    layer_shapes,
    preset_help,
)

# ---------------------------------------------------------------------------
# Parsing and printing

FORMS = [
    "bits=4",
    "bits=8",
    "bits=8,4",
    "bits=8,4 group=64,32",
    "bits=4 group=32 offset=int",
    "bits=8,4 group=64,32 offset=float,int",
    "bits=4 rotate=none first=0",
    "bits=4 rotate=k",
    "bits=16,4",
    "bits=4 group=128 center=kv qscale=q first=32 recent=16",
    "codec=codebook bits=3",
    "codec=codebook,affine bits=3,4 group=64,32",
    "codec=codebook bits=4 rotate=none debias=1.5",
    "codec=codebook bits=4 center=k qscale=qk first=8 more=k5 layers=4,8",
    "bits=4,3 more=kv8 fit=4.6",
    "bits=2 more=v4 layers=0",
]


@pytest.mark.parametrize("text", FORMS + list(PRESETS))
def test_parse_and_print_round_trip(text):
    spec = KVSpec.parse(text)
    assert str(spec) == text and not spec.is_reference
    again = KVSpec.parse(spec.text)
    assert again == spec and again.text == spec.text
    if text in PRESETS:
        assert spec == KVSpec.parse(PRESETS[text])
        assert spec.text == PRESETS[text]
    else:
        assert spec.text == text  # the forms are in the printer's order


def test_presets_can_be_changed_by_items():
    spec = KVSpec.parse("q4 first=16 recent=0")
    base = KVSpec.parse("q4")
    assert (spec.first, spec.recent, base.first, base.recent) == (16, 0, 8, 72)
    assert spec.bits == base.bits == (4, 4) and spec.group == (64, 64)
    assert KVSpec.parse("cq4 fit=4.2").fit == 4.2
    assert KVSpec.parse("  cq4   first=4 ") == KVSpec.parse("cq4 first=4")
    for name in PRESETS:
        assert f"{name}: {PRESETS[name]}" in preset_help()


@pytest.mark.parametrize("text", ["fp16", "", "  "])
def test_fp16_is_the_models_own_cache(text):
    spec = KVSpec.parse(text)
    assert spec.is_reference and spec.text == "fp16" and spec == KVSpec()


@pytest.mark.parametrize("text,first", [("4", 32), ("8,4", 16), ("8,4 center=k", 32)])
def test_a_lone_number_is_bits(text, first):
    # as --kv-bits takes them
    spec = KVSpec.parse(text)
    assert spec == KVSpec.parse(f"bits={text}") and str(spec) == text
    assert spec.text == f"bits={text}" and spec.first_tokens == first


def test_items_the_parser_reads():
    spec = KVSpec.parse(
        "codec=codebook,affine bits=3,4 group=64,32 rotate=v center=kv qscale=q "
        "first=4 recent=24 debias=2 more=k5 layers=8,4,8"
    )
    assert spec.codec == ("codebook", "affine") and spec.bits == (3, 4)
    assert spec.group == (64, 32) and spec.rotate == "v"
    assert (spec.center, spec.key_scale, spec.first, spec.recent) == ("kv", "q", 4, 24)
    assert spec.debias == 2.0 and spec.more == "k5" and spec.layers == (4, 8)
    # none: off
    spec = KVSpec.parse("bits=4 center=none qscale=none")
    assert (spec.center, spec.key_scale) == ("", "")


# ---------------------------------------------------------------------------
# Errors: one per bad item, naming it


@pytest.mark.parametrize(
    "text,match",
    [
        ("bits", r"'bits': expected name=value"),
        ("bits=4 center", r"'center': expected name=value"),
        ("bits=", r"'bits=': expected name=value"),
        ("bitz=4", r"Unknown scheme item 'bitz'"),
        ("bits=4 fp16", r"'fp16': expected name=value"),
        ("cq4 q4", r"'q4': expected name=value"),
        ("bits=4,4,4", r"bits='4,4,4': expected one value or two"),
        ("bits=4,", r"bits='4,': expected one value or two"),
        ("bits=four", r"bits='four': not a number"),
        ("bits=7", r"KV cache bits must be one of"),
        ("bits=1", r"KV cache bits must be one of"),
        ("codec=codebook bits=7", r"Codebook bits must be 1 to 6"),
        ("bits=4 group=48", r"group size must be one of"),
        ("bits=4 group=x", r"group='x': not a number"),
        ("bits=4 offset=half", r"offset='half': one of float, int"),
        ("bits=4,3 offset=int", r"offset=int takes bits 2, 4 or 8"),
        ("codec=turbo bits=4", r"codec='turbo': one of affine, codebook"),
        ("bits=4 rotate=q", r"rotate='q': one of kv, k, v, none"),
        ("bits=4 center=v", r"center='v': one of k, kv, none"),
        ("bits=4 qscale=k", r"qscale='k': one of q, qk, none"),
        ("bits=4 first=x", r"first='x': a number of tokens"),
        ("bits=4 first=-1", r"first must be 0 or more"),
        ("bits=4 recent=12", r"recent must be 0 or a multiple of 8"),
        ("bits=4 debias=a", r"debias='a': a number"),
        ("bits=4 more=k", r"more='k': kB, vB or kvB"),
        ("bits=4 more=q5 layers=1", r"more='q5': kB, vB or kvB"),
        ("bits=4 more=k9 layers=1", r"KV cache bits must be one of"),
        ("bits=4 more=k5", r"more= needs layers= or fit="),
        ("bits=4 more=k5 layers=1 fit=4", r"layers= and fit= exclude each other"),
        ("bits=4 layers=1", r"layers= and fit= need more="),
        ("bits=4 fit=4.6", r"layers= and fit= need more="),
        ("bits=4 more=k5 layers=a", r"layers='a': layer numbers"),
        ("bits=4 more=k5 fit=x", r"fit='x': a number"),
        ("center=k", r"center=k: a scheme needs bits= \(or a preset\)"),
        ("first=4 recent=8", r"a scheme needs bits= \(or a preset\)"),
        (
            "bits=8 center=k first=0",
            r"center= and qscale= .* need first=2 or more, got first=0",
        ),
        (
            "codec=codebook bits=4 qscale=q first=0",
            r"need first=2 or more, got first=0",
        ),
        ("bits=4 center=kv first=1", r"need first=2 or more, got first=1"),
        ("cq4 first=0", r"need first=2 or more, got first=0"),
    ],
)
def test_a_bad_item_is_named(text, match):
    with pytest.raises(ValueError, match=match):
        KVSpec.parse(text)


# ---------------------------------------------------------------------------
# Defaults


@pytest.mark.parametrize(
    "text,rotation,first",
    [
        ("bits=8", (False, False), 0),
        ("bits=16", (False, False), 0),
        ("bits=4", (True, True), 32),
        ("bits=4 center=none qscale=none", (True, True), 16),
        ("bits=8,4", (True, True), 16),
        ("bits=16,4", (True, True), 16),
        ("bits=4 rotate=none", (False, False), 32),
        ("bits=4 rotate=v first=2", (False, True), 2),
        ("bits=8 first=4", (False, False), 4),
    ],
)
def test_rotation_and_first_tokens_when_a_part_has_fewer_than_8_bits(
    text, rotation, first
):
    spec = KVSpec.parse(text)
    assert spec.rotation == rotation and spec.first_tokens == first
    keys, values = spec.codecs()
    for codec, bits, rotated in zip((keys, values), spec.bits, rotation):
        if bits == 16:
            assert codec == Plain()
        else:
            assert codec == Affine(bits, 64, "hadamard" if rotated else "none")
    assert spec.settings()["first"] == first


def test_codebooks_rotate_and_keep_no_first_tokens_by_default():
    spec = KVSpec.parse("codec=codebook bits=3,4")
    assert spec.codecs() == (Codebook(3), Codebook(4)) and spec.first_tokens == 0
    # a codebook part keeps none either (affine keys under 8 bits: their
    # transform's 32); first= says otherwise
    assert KVSpec.parse("codec=codebook,affine bits=3,4").first_tokens == 0
    assert KVSpec.parse("codec=affine,codebook bits=4,3").first_tokens == 32
    assert KVSpec.parse("codec=codebook bits=3 first=8").first_tokens == 8
    assert KVSpec.parse("codec=codebook bits=3 rotate=none").codecs()[0] == Codebook(
        3, "none"
    )
    # the correction is the keys' alone
    keys, values = KVSpec.parse("codec=codebook bits=4 debias=2").codecs()
    assert keys == Codebook(4, debias=2.0) and values == Codebook(4)
    # a part of each codec
    assert KVSpec.parse("codec=affine,codebook bits=8,3").codecs() == (
        Affine(8, 64, "hadamard"),
        Codebook(3),
    )


def test_more_bits_for_the_listed_layers():
    spec = KVSpec.parse("bits=4,3 group=64,32 more=k8 layers=1")
    assert spec.more_codecs() == (Affine(8, 64, "hadamard"), Affine(3, 32, "hadamard"))
    spec = KVSpec.parse("codec=codebook bits=4 more=kv5 layers=0")
    assert spec.more_codecs() == (Codebook(5), Codebook(5))
    fitted = KVSpec.parse("cq4")
    resolved = fitted.with_layers([9, 2])
    assert resolved.layers == (2, 9) and resolved.fit is None
    assert resolved.text.endswith("more=k5 layers=2,9")


# ---------------------------------------------------------------------------
# The footprint


def used_bytes(store):
    """What a store holds for its tokens: the pages' rows written (not the
    preallocated rest), the kept and held tokens and the transform."""
    pages = 0
    for part in (store.key_pages, store.value_pages):
        rows = store._written - store.dropped
        for page in part:
            size = page[0].shape[2]
            pages += sum(x.nbytes // size for x in page) * max(0, min(size, rows))
            rows -= size
    return pages + store.spans.nbytes + store.transform.nbytes


def preallocated_bytes(store):
    """The bytes of the pages' rows not written yet."""
    return store.nbytes - used_bytes(store)


def replayed(spec, model, prefill, max_kv_size=None, dtype=mx.bfloat16):
    """The spec's stores for ``model`` after its recorded prefill, replayed
    in ``dtype`` (a 16-bit model's activations)."""
    caches = spec.make_cache(model, max_kv_size)
    for store, (keys, values, queries, scale) in zip(caches, prefill):
        keys, values, queries = (x.astype(dtype) for x in (keys, values, queries))
        store.update_and_fetch(keys, values)
        store.scaled_dot_product_attention(
            queries, None, None, scale=scale, mask="causal"
        )
    return caches


SCHEMES = ["cq4", "q4", "q4-recall", "bits=8", "bits=4", "bits=8,4", "bits=16,4"]


@pytest.mark.parametrize("text", SCHEMES)
def test_footprint_is_what_stores_hold_after_a_real_prefill(
    smollm2_f32, smollm2_prefill, text
):
    """SmolLM2's prefill (33 tokens, replayed in bfloat16 into every layer's
    store): the footprint equals the bytes the stores hold for their tokens
    (pages' written rows, kept and held tokens, means and weights). The
    pages are allocated whole (4,096 rows): ``nbytes`` is that plus the
    rows not written yet, exactly."""
    from kv_model_runs import spec_of

    model = smollm2_f32[0]
    spec = spec_of(text)
    shapes = layer_shapes(model)
    assert shapes == [LayerShape(3, 64, 64)] * 30
    T = smollm2_prefill[0][0].shape[2]
    caches = replayed(spec, model, smollm2_prefill)
    footprint = spec.footprint(shapes, T)
    assert sum(used_bytes(c) for c in caches) == pytest.approx(footprint["bytes"])
    for i, (c, shape) in enumerate(zip(caches, shapes)):
        assert used_bytes(c) == pytest.approx(spec.layer_bytes(shape, T, i))
        if c.key_pages:
            unwritten = c.capacity - (c._written - c.dropped)
            page = (*c.key_pages[0], *c.value_pages[0])
            row = sum(x.nbytes for x in page) // c.key_pages[0][0].shape[2]
            assert preallocated_bytes(c) == unwritten * row
        else:  # (q4: a residual of 72 holds the 33 tokens, the first 8 kept too)
            assert c.spans.n_held == T and c.nbytes == used_bytes(c)
            assert c.spans.first_keys.shape[2] == spec.first_tokens == 8
    elements = T * 30 * 3 * 128
    assert footprint["bits_per_element"] == pytest.approx(
        8 * footprint["bytes"] / elements
    )
    assert footprint["bytes_per_token"] == pytest.approx(footprint["bytes"] / T)


def test_footprint_of_a_residual_over_its_cycle():
    """A residual holds R to 2R - 1 tokens unquantized; the footprint takes
    their mean over a cycle, (3R - 1) / 2: the stores hold within half a
    cycle's tokens (each 16 bits instead of the codec's) of it."""
    spec = KVSpec.parse("q4")  # recent=72
    shape = LayerShape(2, 64, 64)
    store = KVStore(*spec.codecs(), **spec.settings())
    keys, values = random_kv(1, 2, 400, 64, seed=1)
    keys, values = keys.astype(mx.bfloat16), values.astype(mx.bfloat16)
    store.update_and_fetch(keys[:, :, :1], values[:, :, :1])
    store.scaled_dot_product_attention(
        keys[:, :, :1], None, None, scale=0.125, mask=None
    )
    # a held token's key and value at 16 bits instead of the codecs'
    held_bytes = sum(16 - c.bits_per_element(64) for c in spec.codecs()) * 2 * 64 / 8
    for t in range(1, 400):
        store.update_and_fetch(keys[:, :, t : t + 1], values[:, :, t : t + 1])
        if t < 143:
            continue
        n = store.spans.n_held
        assert 72 <= n <= 143
        want = spec.layer_bytes(shape, t + 1)
        slack = abs(n - (3 * 72 - 1) / 2) * held_bytes
        assert abs(used_bytes(store) - want) <= slack + 1e-6


def test_footprint_of_windows_counts_the_window():
    spec = KVSpec.parse("bits=4 center=none qscale=none")  # first=16
    window = LayerShape(1, 256, 256, window=512)
    whole = LayerShape(1, 256, 256)
    # a sliding window's first tokens go once no query sees them: the pages
    # hold the window's rows, as a layer of 512 tokens with none kept
    unkept = KVSpec.parse("bits=4 first=0")
    assert spec.layer_bytes(window, 4096) == unkept.layer_bytes(whole, 512)
    assert spec.layer_bytes(window, 100) == spec.layer_bytes(whole, 100)
    # a bounded layer keeps its sinks whatever first= says
    sinks = LayerShape(1, 256, 256, window=256, keep=4)
    # (in the first span only: 16 bits each instead of 4.5 in the pages)
    extra = 4 * 2 * 256 * (16 - 4.5) / 8
    assert unkept.layer_bytes(sinks, 1000) == pytest.approx(
        unkept.layer_bytes(whole, 256) + extra
    )
    # fp16: two bytes an element
    assert KVSpec.parse("fp16").layer_bytes(window, 4096) == 512 * 512 * 2


@pytest.mark.parametrize("keep", [0, 4])
def test_footprint_of_a_window_is_what_its_store_holds(keep):
    """A bounded store, filled 8 tokens at a time: what it holds for its
    tokens once it has dropped what the next query does not see (as the
    next write does) equals the footprint while its window is not full, and
    is within a page of 16 rows of it after (pages are dropped whole)."""
    spec = KVSpec.parse("bits=4 center=none qscale=none")  # first=16
    shape = LayerShape(2, 64, 64, window=64, keep=keep)
    store = KVStore(*spec.codecs(), first=16, window=64, keep=keep, page_size=16)
    keys, values = random_kv(1, 2, 400, 64, seed=2)
    keys, values = keys.astype(mx.bfloat16), values.astype(mx.bfloat16)
    row_bytes = sum(c.bits_per_element(64) for c in spec.codecs()) * 2 * 64 / 8
    for t in range(8, 401, 8):
        store.update_and_fetch(keys[:, :, t - 8 : t], values[:, :, t - 8 : t])
        store._drop(store._drop_to())
        want = spec.layer_bytes(shape, t)
        if t < 64:
            assert used_bytes(store) == pytest.approx(want), t
        else:
            assert 0 <= used_bytes(store) - want <= 16 * row_bytes, t
    assert (store.spans.first_keys is None) == (keep == 0)


def test_bits_per_element_at_the_average_context():
    shapes = [LayerShape(8, 128, 128)] * 4
    assert AVERAGE_CONTEXT == 4096

    def bits(text):
        return KVSpec.parse(text).footprint(shapes, AVERAGE_CONTEXT)["bits_per_element"]

    assert bits("fp16") == 16
    assert bits("bits=8") == 8.5
    assert bits("bits=16") == 16
    # 4.5 bits, and 16 tokens at 16 bits instead (in the first span only);
    # centering: a float32 vector a head (its keys' 32 bits, over keys and
    # values' 2 x 4096 rows)
    plain = "center=none qscale=none"
    assert bits(f"bits=4 {plain}") == pytest.approx(4.5 + 16 * (16 - 4.5) / 4096)
    assert bits("bits=4 center=k qscale=none first=16") == pytest.approx(
        4.5 + 16 * (16 - 4.5) / 4096 + 32 / 4096 / 2
    )
    # by default: 32 first tokens, keys centered and weighted (two vectors)
    assert bits("bits=4") == pytest.approx(4.5 + 32 * (16 - 4.5) / 4096 + 32 / 4096)
    assert bits("codec=codebook bits=3") == pytest.approx(3 + 16 / 128)
    # layers with more bits cost theirs
    assert bits("codec=codebook bits=3 more=k5 layers=0,1") == pytest.approx(
        3.125 + 2 * 2 / 4 / 2
    )


# ---------------------------------------------------------------------------
# Caches for real models


def test_make_cache_for_smollm2(smollm2_f32):
    model = smollm2_f32[0]
    assert all(type(c) is KVCache for c in KVSpec.parse("fp16").make_cache(model))
    spec = KVSpec.parse("q4 more=k8 layers=0,29")
    caches = spec.make_cache(model)
    assert len(caches) == 30 and all(type(c) is KVStore for c in caches)
    assert all(c.window is None and c.page_size == 4096 for c in caches)
    assert caches[0].key_codec == Affine(8, 64, "hadamard")
    assert caches[1].key_codec == Affine(4, 64, "hadamard")
    assert {c.value_codec for c in caches} == {Affine(4, 64, "hadamard")}
    s = caches[5].settings
    assert (s["center"], s["key_scale"], s["first"], s["recent"]) == ("k", "qk", 8, 72)
    # --max-kv-size: every layer bounded, its 4 sinks kept, no residual
    bounded = spec.make_cache(model, 256)
    assert {(c.window, c.keep, c.spans.recent) for c in bounded} == {(256, 4, 0)}
    assert bounded[3].spans.first == 8 and bounded[3].page_size == 256


def test_fitted_layers_and_layers_out_of_range(smollm2_f32):
    model = smollm2_f32[0]
    with pytest.raises(ValueError, match=r"fit=4.6 needs the model's fitted layers"):
        KVSpec.parse("cq4").make_cache(model)
    with pytest.raises(ValueError, match="layer 30 of a model with 30 layers"):
        KVSpec.parse("bits=4 more=k8 layers=2,30").make_cache(model)
    caches = KVSpec.parse("cq4").with_layers([29]).make_cache(model)
    assert [c.key_codec.bits for c in caches] == [4] * 29 + [5]


def test_make_cache_for_gemma3(gemma3_f32_model):
    """Gemma-3-270M: five 512-token sliding layers for each global one; the
    sliding ones become windowed stores (pages of the window, no residual)."""
    model = gemma3_f32_model
    caches = KVSpec.parse("q4").make_cache(model)
    assert len(caches) == 18 and all(type(c) is KVStore for c in caches)
    windows = [c.window for c in caches]
    assert windows == ([512] * 5 + [None]) * 3
    for c in caches:
        if c.window:
            assert (c.keep, c.page_size, c.spans.recent, c.spans.first) == (
                0,
                512,
                0,
                8,
            )
        else:
            assert (c.spans.recent, c.page_size) == (72, 4096)
    shapes = layer_shapes(model)
    assert shapes[0] == LayerShape(1, 256, 256, window=512)
    assert shapes[5] == LayerShape(1, 256, 256)
    # the model's own caches
    own = KVSpec.parse("fp16").make_cache(model)
    assert [type(c) for c in own[:6]] == [RotatingKVCache] * 5 + [KVCache]
    # bounded: the global layers too, with 4 sinks
    bounded = KVSpec.parse("bits=4").make_cache(model, 256)
    assert (bounded[5].window, bounded[5].keep) == (256, 4)
    assert (bounded[0].window, bounded[0].keep) == (512, 0)
    with pytest.raises(ValueError, match="layer 18 of a model with 18 layers"):
        KVSpec.parse("bits=4 more=k8 layers=18").make_cache(model)
    # a token through the stores
    out = model(mx.array([[2, 100, 200]]), cache=caches)
    assert out.shape == (1, 3, 262144) and not mx.isnan(out).any().item()
