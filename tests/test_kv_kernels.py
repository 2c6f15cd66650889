"""The kernel registry (``omlx_cache.kv.kernels``) and the CUDA kernels
(``omlx_cache.kernels``).

On the CPU: the kernels registered, ``disabled()``, that no kernel applies,
how attention and stores use a kernel (a stand-in registered here: a kernel
that runs, one that declines, one that holds decode tokens), the kernels'
pure-Python and MLX-ops parts (the codebook kernels' level tables emulated
lane by lane from their own constants, their names, templates and switches;
the affine kernels' first tokens as held ones and their decoded prefill).
On CUDA (skipped elsewhere): each kernel against ``kernels.disabled()``, the
MLX-ops reference."""

import itertools
import re

import mlx.core as mx
import numpy as np
import pytest
from kv_helpers import random_kv, reference, relative_error, stored

from omlx_cache import kernels as backend
from omlx_cache.kernels import affine_decode, affine_prefill
from omlx_cache.kernels import codebook as codebook_kernel
from omlx_cache.kv import Affine, BatchKVStore, Codebook, KVStore, attention, kernels
from omlx_cache.kv.attention import Call, First, Recent, ops_attention
from omlx_cache.kv.codebook import lloyd_max, pack
from omlx_cache.kv.kernels import Hold, Kernel
from omlx_cache.kv.rotation import rotate

ON_CUDA = mx.default_device() == mx.gpu and mx.cuda.is_available()
cuda_only = pytest.mark.skipif(
    not ON_CUDA, reason="needs CUDA as the default device (sm_80 or later)"
)
NAMES = ["affine-decode", "affine-prefill", "codebook", "codebook-encode"]


def call_of(store, queries, mask=None, scale=0.125):
    """The attention call a store makes for ``queries`` (as
    ``scaled_dot_product_attention`` builds it)."""
    made = []

    def capture(call):
        made.append(call)
        return True

    kernels.register_attention(Kernel("test-capture", capture, lambda c: None))
    try:
        store.scaled_dot_product_attention(queries, None, None, scale, mask)
    finally:
        unregister("test-capture")
    return made[0]


def unregister(*names):
    kernels._attention[:] = [k for k in kernels._attention if k.name not in names]
    kernels._encoders[:] = [k for k in kernels._encoders if k.name not in names]


@pytest.fixture
def register():
    """Register stand-in attention kernels for one test."""
    added = []

    def add(*args, **kwargs):
        kernel = Kernel(*args, **kwargs)
        kernels.register_attention(kernel)
        added.append(kernel.name)
        return kernel

    yield add
    unregister(*added)


# ---------------------------------------------------------------------------
# The registry


def test_the_kernels_register_themselves_at_the_first_use():
    assert kernels.names() == NAMES
    assert [k.name for k in kernels.attention_kernels()] == NAMES[:3]
    # each attention kernel that attends held decode tokens says how many
    holds = {k.name: k.hold is not None for k in kernels.attention_kernels()}
    assert holds == {"affine-decode": True, "affine-prefill": False, "codebook": True}


def test_disabled_switches_kernels_off_by_name_and_all_of_them():
    with kernels.disabled("codebook"):
        assert [k.name for k in kernels.attention_kernels()] == NAMES[:2]
        with kernels.disabled("affine-decode"):
            assert [k.name for k in kernels.attention_kernels()] == ["affine-prefill"]
        assert len(kernels.attention_kernels()) == 2
        with kernels.disabled():
            assert kernels.attention_kernels() == []
    assert [k.name for k in kernels.attention_kernels()] == NAMES[:3]
    with kernels.disabled():
        x = mx.zeros((1, 2, 1, 64))
        assert kernels.encode(x, Codebook(3)) is None
        assert kernels.hold(x, x, Codebook(3), Codebook(3)) is None
    # the registry is whole again after an exception in the block
    with pytest.raises(RuntimeError), kernels.disabled():
        raise RuntimeError
    assert len(kernels.attention_kernels()) == 3


STORES = {
    "affine-8,4": lambda: KVStore(Affine(8), Affine(4)),
    "affine-4-first": lambda: KVStore(Affine(4, 64, "hadamard"), first=4),
    "codebook-3,4": lambda: KVStore(3, 4),
    "codebook-4-centered": lambda: KVStore(4, center="kv", key_scale="q", first=8),
    "codebook-5k-4v-batch": lambda: BatchKVStore([0, 3], 5, 4),
}


@pytest.mark.skipif(ON_CUDA, reason="the kernels apply on CUDA")
@pytest.mark.parametrize("name", list(STORES))
@pytest.mark.parametrize("L", [1, 16])
def test_no_kernel_applies_off_cuda(name, L):
    s = STORES[name]()
    B = 2 if "batch" in name else 1
    keys, values = random_kv(B, 2, 40, 128, seed=1)
    s.update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))
    queries = mx.random.normal((B, 8, L, 128)).astype(mx.float16)
    mask = s.make_mask(L) if B > 1 else "causal" if L > 1 else None
    call = call_of(s, queries, mask)
    # each declines: ``applies`` (a first, cheap look) or ``run``
    for kernel in kernels.attention_kernels():
        assert not kernel.applies(call) or kernel.run(call) is None, kernel.name
    assert not backend._decode_applies(call) and backend._prefill_path(call) is None
    assert kernels.encode(keys, s.key_codec) is None
    assert (
        kernels.hold(keys[:, :, :1], values[:, :, :1], s.key_codec, s.value_codec)
        is None
    )
    assert not codebook_kernel.encodes(keys, Codebook(3))
    assert not codebook_kernel.holds(keys, keys, Codebook(3), Codebook(3))
    assert not affine_decode.takes_held_tokens(keys, values, 8, 4)
    assert s.spans.hold in (None, False)


def test_a_kernel_that_applies_runs_and_one_that_declines_falls_through(register):
    s = KVStore(3, 4)
    keys, values = random_kv(1, 2, 50, 64, seed=2)
    s.update_and_fetch(keys, values)
    queries = mx.random.normal((1, 4, 1, 64))
    ops = s.scaled_dot_product_attention(queries, None, None, 0.125, None)
    seen = []

    def decline(call):
        seen.append("decline")

    register("test-decline", lambda call: True, decline)
    register("test-skip", lambda call: False, lambda call: seen.append("skip"))
    out = s.scaled_dot_product_attention(queries, None, None, 0.125, None)
    assert seen == ["decline"] and mx.array_equal(out, ops)
    # one that runs: its output is the call's
    register("test-run", lambda call: call.length == 50, lambda call: call.queries * 2)
    out = s.scaled_dot_product_attention(queries, None, None, 0.125, None)
    assert mx.array_equal(out, queries * 2)
    with kernels.disabled("test-run"):
        out = s.scaled_dot_product_attention(queries, None, None, 0.125, None)
        assert mx.array_equal(out, ops)
    # registering a name again replaces the kernel
    register("test-run", lambda call: True, lambda call: call.queries * 3)
    assert [k.name for k in kernels._attention].count("test-run") == 1
    out = s.scaled_dot_product_attention(queries, None, None, 0.125, None)
    assert mx.array_equal(out, queries * 3)


def test_the_call_a_store_makes():
    s = KVStore(
        Codebook(3), Affine(4, 64, "hadamard"), center="kv", key_scale="qk", first=4
    )
    keys, values = random_kv(1, 2, 30, 64, seed=3, offset=3)
    s.update_and_fetch(keys, values)
    queries = mx.random.normal((1, 4, 30, 64))
    call = call_of(s, queries, "causal")
    # the pages hold rows 4 to 29: the first tokens are in the first span only
    assert call.length == call.total == 26 and call.mask == "causal"
    assert call.key_codec == Codebook(3) and call.value_codec.bits == 4
    # the transform, fixed by this call's queries at positions 1 to 3
    assert call.key_mean is s.transform.key_mean is not None
    assert call.value_mean is s.transform.value_mean is not None
    assert call.key_weights is s.transform.key_weights is not None
    assert call.recent is None and call.sinks is None
    # the first tokens, centered, weighted and rotated as the pages' rows
    # at rows -4 to -1 of the pages: none of them to hide
    assert (call.first.first, call.first.count, call.first.mask) == (-4, 4, None)
    assert call.first.keys is s.spans.first_keys
    t = s.transform
    want = rotate((keys[:, :, :4] - t.key_mean) * t.key_weights, "hadamard")
    assert mx.allclose(call.first.keys, want, atol=1e-5)
    # queries divided by the key weights, rotated as the keys are
    want = rotate(queries / mx.repeat(call.key_weights, 2, axis=1), "hadamard")
    assert mx.allclose(call.rotated_queries(), want, atol=1e-5)


# ---------------------------------------------------------------------------
# Decode tokens held for a kernel


def held_for_the_test(rotated):
    """A stand-in kernel's hold: up to 4 decode tokens, held as the codebook
    kernel holds them (centered and weighted, the newest as it came) or as
    the affine one does (rotated too)."""
    return lambda *args: Hold(4, rotated=rotated, incoming=not rotated)


@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize(
    "settings",
    [{}, {"center": "kv", "first": 8}, {"center": "k", "key_scale": "q", "first": 4}],
)
def test_held_decode_tokens_change_nothing_but_when_they_are_encoded(
    register, rotated, settings
):
    """Held decode tokens are attended as they came (the MLX-ops loop lands
    the newest one first), written to the pages when the buffer is full and
    one more comes, and before state, trim or a batch read the pages: the
    pages then equal those of a store that held nothing."""
    register(
        "test-hold", lambda call: False, lambda call: None, held_for_the_test(rotated)
    )
    prompt, prompt_values = random_kv(1, 2, 50, 64, seed=3)
    steps, step_values = random_kv(1, 2, 11, 64)
    queries = mx.random.normal((1, 4, 50, 64))
    stores = [KVStore(3, 4, **settings) for _ in range(2)]
    for s in stores:
        s.update_and_fetch(prompt, prompt_values)
        s.scaled_dot_product_attention(queries, None, None, 0.125, "causal")
    plain, holding = stores
    q = mx.random.normal((1, 4, 1, 64))
    for t in range(11):
        token = steps[:, :, t : t + 1], step_values[:, :, t : t + 1]
        with kernels.disabled("test-hold"):
            plain.update_and_fetch(*token)
        holding.update_and_fetch(*token)
        assert holding.spans.n_held == t % 4 + 1
        # the newest waits as it came until attention lands it
        assert (holding.spans.incoming is not None) == (not rotated)
        out = holding.scaled_dot_product_attention(q, None, None, 0.125, None)
        assert holding.spans.incoming is None
        assert relative_error(out, reference(holding, q, None)) < 1e-4
        k, v = stored(holding)
        n = holding.spans.n_held
        came = [x[:, :, t + 1 - n : t + 1] for x in (steps, step_values)]
        assert mx.allclose(k[:, :, -n:], came[0], atol=1e-4)
        assert mx.allclose(v[:, :, -n:], came[1], atol=1e-4)
        want = plain.scaled_dot_product_attention(q, None, None, 0.125, None)
        assert relative_error(out, want) < 0.1  # (the held ones unquantized)
    assert holding.offset == plain.offset == 61
    assert holding._written == 58 and holding.spans.n_held == 3
    # a state writes them: the same pages, and no held tokens in it
    state = holding.state
    assert holding.spans.n_held == 0 and state[4] is None
    for a, b in zip(plain.keys_and_values(), holding.keys_and_values()):
        assert all(mx.array_equal(x, y) for x, y in zip(a, b))
    restored = KVStore.from_state(state)
    assert restored.offset == 61
    # trim writes them too, then trims
    holding.update_and_fetch(steps[:, :, :1], step_values[:, :, :1])
    assert holding.spans.n_held == 1 and holding.trim(3) == 3
    assert holding.spans.n_held == 0 and holding.offset == 59


def test_a_state_with_held_tokens_but_no_residual_is_refused():
    s = KVStore(Affine(4), recent=8)
    s.update_and_fetch(*random_kv(1, 2, 12, 64, seed=1))
    state = list(s.state)
    assert s.spans.n_held == 12 and state[4] is not None
    settings = state[-1].replace('"recent": 8', '"recent": 0')
    with pytest.raises(ValueError, match="no residual"):
        KVStore.from_state([*state[:-1], settings])


def test_first_tokens_are_stored_before_decode_tokens_are_held(register):
    """A store keeping its first tokens holds decode tokens only once those
    are written (they are kept as they are written to the pages)."""
    register(
        "test-hold", lambda call: False, lambda call: None, held_for_the_test(False)
    )
    prompt, values = random_kv(1, 2, 40, 64, seed=5)
    steps, step_values = random_kv(1, 2, 3, 64)
    kept = [KVStore(3, first=n) for n in (4, 42)]
    for s in kept:
        s.update_and_fetch(prompt, values)
        for t in range(3):
            s.update_and_fetch(steps[:, :, t : t + 1], step_values[:, :, t : t + 1])
    assert [s.spans.n_held for s in kept] == [3, 1]
    assert kept[1].spans.first_keys.shape[2] == 42
    k, _ = stored(kept[1])
    assert mx.allclose(k[:, :, 40:42], steps[:, :, :2], atol=1e-4)


def test_a_batch_writes_held_tokens_before_it_moves_pages(register):
    register(
        "test-hold", lambda call: False, lambda call: None, held_for_the_test(True)
    )
    stores = []
    for n in (20, 35):
        s = KVStore(Affine(4, 64, "hadamard"))
        s.update_and_fetch(*random_kv(1, 2, n, 64, seed=n))
        for _ in range(2):
            s.update_and_fetch(*random_kv(1, 2, 1, 64))
        assert s.spans.n_held == 2
        stores.append(s)
    batch = KVStore.merge(stores)
    assert all(s.spans.n_held == 0 for s in stores)
    assert batch.offset.tolist() == [22, 37] and batch.spans.n_held == 0
    # a decode step, its mask made before the write (as a model makes it:
    # the mask's columns end at the row written)
    queries = mx.random.normal((2, 4, 1, 64))
    keys, values = random_kv(2, 2, 1, 64)
    mask = batch.make_mask(1)
    batch.update_and_fetch(keys, values)
    out = batch.scaled_dot_product_attention(queries, None, None, 0.125, mask)
    for i, s in enumerate(stores):
        s.update_and_fetch(keys[i : i + 1], values[i : i + 1])
        want = s.scaled_dot_product_attention(
            queries[i : i + 1], None, None, 0.125, None
        )
        assert relative_error(out[i : i + 1], want) < 1e-4


# ---------------------------------------------------------------------------
# The affine kernels' MLX-ops parts


def affine_call(B=1, length=90, L=1, first=None, held=0, mask=None, seed=0):
    mx.random.seed(seed)
    codec = Affine(8, 64, "hadamard")
    keys, values = random_kv(B, 2, length, 64)
    pages, vpages = [codec.empty_page(keys, 128)], [codec.empty_page(values, 128)]
    for page, x in ((pages[0], keys), (vpages[0], values)):
        for dst, src in zip(page, codec.encode(x)):
            dst[:, :, :length] = src
    queries = mx.random.normal((B, 6, L, 64))
    call = Call(queries, 0.125, mask, None, codec, codec, pages, vpages, length)
    if first is not None:
        fk, fv = random_kv(B, 2, 8, 64)
        call.first = First(rotate(fk, "hadamard"), rotate(fv, "hadamard"), first, 8)
    if held:
        hk, hv = random_kv(B, 2, 16, 64)
        call.recent = Recent(rotate(hk, "hadamard"), rotate(hv, "hadamard"), held)
    return call


@pytest.mark.parametrize(
    "first,B,mask",
    [(0, 1, None), (0, 1, "bool"), (0, 1, "additive"), ("rows", 3, "bool")],
)
@pytest.mark.parametrize("held", [0, 5])
def test_decode_reads_first_tokens_as_held_ones(first, B, mask, held):
    """``affine_decode.first_tokens_mask``: the decode kernel takes a store's
    first tokens ahead of its held tokens, their copies in the pages hidden
    by the mask; as the MLX-ops loop attends them."""
    if first == "rows":
        first = mx.array([0, 10, 33])
    total = 90 + held
    if mask is not None:
        padding = mx.array([0, 10, 33][:B])
        visible = (mx.arange(total)[None] >= padding[:, None])[:, None, None]
        mask = visible if mask == "bool" else mx.where(visible, 0.0, -1e9)
    call = affine_call(B=B, first=first, held=held, mask=mask)
    want = ops_attention(call)
    first, recent = call.first, call.recent
    keys, values = first.keys, first.values
    if recent is not None:
        keys = mx.concatenate([keys, recent.keys[:, :, : recent.count]], axis=2)
        values = mx.concatenate([values, recent.values[:, :, : recent.count]], axis=2)
    new_mask = affine_decode.first_tokens_mask(
        first.first, first.count, held, call.mask, call.length, B
    )
    assert new_mask.shape[-1] == total + 8
    call.first, call.mask = None, new_mask
    call.recent = Recent(keys, values, keys.shape[2])
    assert relative_error(ops_attention(call), want) < 1e-5


def test_the_first_tokens_mask_is_made_once_a_step():
    """A step's layers share the model's mask and their first tokens' rows:
    the decode kernel's mask is made by the first layer only; another mask,
    other rows or more held tokens make it anew."""
    padding = mx.array([0, 10, 33])
    visible = (mx.arange(95)[None] >= padding[:, None])[:, None, None]
    layers = [affine_call(B=3, first=padding, held=5, mask=visible) for _ in range(3)]
    for call in layers:
        call.first = call.first._replace(key=((0, 10, 33), 0))
    made = [backend._first_mask(call, 5) for call in layers]
    assert made[1] is made[0] and made[2] is made[0]
    want = affine_decode.first_tokens_mask(padding, 8, 5, visible, 90, 3)
    assert mx.array_equal(made[0], want)
    other = layers[0]
    assert backend._first_mask(other, 4) is not made[0]
    other.mask = visible[..., :]
    assert backend._first_mask(other, 5) is not made[0]
    other.first = other.first._replace(key=((0, 11, 33), 0))
    again = backend._first_mask(other, 5)
    assert backend._first_mask(other, 5) is again
    # without a key (rows the store does not name) it is made every time
    other.first = other.first._replace(key=None)
    assert backend._first_mask(other, 5) is not backend._first_mask(other, 5)


@pytest.mark.parametrize("mask", [None, "bool", "additive"])
@pytest.mark.parametrize("held", [0, 5])
def test_decode_takes_first_tokens_before_the_pages_as_held_ones(mask, held):
    """A sequence's first tokens at rows -8 to -1 (its pages begin after
    them): the decode kernel takes them ahead of its held tokens
    (``kernels._decode``), a mask array getting them as visible columns
    between the pages' and the held ones' (``first_tokens_visible``); as
    the MLX-ops loop attends them. The codebook decode kernel, which reads
    their visibility from the mask at their rows, leaves such a call with a
    mask array to the loop."""
    total = 90 + held
    if mask is not None:
        visible = (mx.arange(total) % 7 != 3)[None, None, None]
        mask = visible if mask == "bool" else mx.where(visible, 0.0, -1e9)
    call = affine_call(first=-8, held=held, mask=mask)
    want = ops_attention(call)
    first, recent = call.first, call.recent
    keys, values = first.keys, first.values
    if recent is not None:
        keys = mx.concatenate([keys, recent.keys[:, :, : recent.count]], axis=2)
        values = mx.concatenate([values, recent.values[:, :, : recent.count]], axis=2)
    new_mask = backend.first_tokens_visible(call.mask, call.length, 8)
    if mask is not None:
        assert new_mask.shape[-1] == total + 8
    call.first, call.mask = None, new_mask
    call.recent = Recent(keys, values, keys.shape[2])
    assert relative_error(ops_attention(call), want) < 1e-5
    decline = affine_call(first=-8, held=held, mask=mask)
    assert backend._codebook_applies(decline) == (mask is None)


def decoded(call, **extra):
    """``affine_prefill.decoded_attention`` over what ``call`` attends, its
    output finished as the store finishes it."""
    k, v = call.key_codec, call.value_codec
    out = affine_prefill.decoded_attention(
        call.rotated_queries(),
        call.key_pages,
        call.value_pages,
        call.scale,
        call.length,
        k.group_size,
        k.bits,
        v.group_size,
        v.bits,
        **extra,
    )
    return call.finish(out)


@pytest.mark.parametrize("first,held", [(None, 0), (0, 0), (0, 5), (None, 7)])
def test_decoded_prefill_attends_as_the_ops_loop(first, held):
    """``affine_prefill.decoded_attention`` (the CUDA prefill path over
    dequantized copies; MLX ops, so it runs here in float32) over the
    pages, the first tokens in place of their copies and the held ones."""
    call = affine_call(L=20, first=first, held=held, mask="causal")
    want = ops_attention(call)
    out = decoded(
        call, mask="causal", exact=backend._first(call), held=backend._held(call)
    )
    assert relative_error(out, want) < 1e-5


def prefilled(store, lengths, L, seed, mask_kind="causal"):
    """``store`` (a ``KVStore``, or a ``BatchKVStore`` of equal padding) fed
    chunks of ``lengths`` tokens (B and heads as the store's first write
    says: 2 sequences for a batch, else 1; 2 KV heads), each attended; the
    last chunk's ``L`` queries, mask (made before its write, as a model
    makes it: "causal", or a boolean or additive array) and the attention
    call the store makes for them."""
    B = 2 if isinstance(store, BatchKVStore) else 1
    keys, values = random_kv(B, 2, sum(lengths), 64, seed=seed, offset=2)
    start = 0
    for i, n in enumerate(lengths):
        last = i == len(lengths) - 1
        array = last and mask_kind != "causal"
        mask = store.make_mask(n, return_array=array)
        if array and mask_kind == "additive":
            mask = mx.where(mask, 0.0, -1e9)
        store.update_and_fetch(
            keys[:, :, start : start + n], values[:, :, start : start + n]
        )
        queries = mx.random.normal((B, 6, n, 64))
        if last:
            return queries, mask, call_of(store, queries, mask)
        store.scaled_dot_product_attention(queries, None, None, 0.125, mask)
        start += n


def past_padding(store, L):
    """The last ``L`` queries' rows at or after every sequence's left padding
    (queries that see no key have no defined output)."""
    padding = max(store.left_padding_array().tolist())
    return slice(max(padding - (store._idx - L), 0), None)


def first_as_int(call):
    """The call's first tokens with one row for every sequence (a batch of
    equal padding) as the prefill kernels take them: an int."""
    keys, values, first, count = call.first[:4]
    if not isinstance(first, int):
        rows = set(first.tolist())
        assert len(rows) == 1
        first = rows.pop()
    return keys, values, first, count


AFFINE_PREFILL = {
    # the pages begin after a sequence's first tokens: rows -8 to -1
    "outside": (
        lambda: KVStore(Affine(8, 64, "hadamard"), Affine(4, 64, "hadamard"), first=8),
        (60, 20),
        -8,
    ),
    "outside-transform": (
        lambda: KVStore(
            Affine(4, 64, "hadamard"), center="kv", key_scale="qk", first=16
        ),
        (5, 40, 20),
        -16,
    ),
    # first tokens and a residual's held tokens around the pages
    "outside-held": (
        lambda: KVStore(Affine(8, 64, "hadamard"), first=8, recent=16),
        (50, 20),
        -8,
    ),
    # a chunk that completes the first tokens: 3 of them, in the pages of
    # no store, before row 0 (the rest of the chunk follows them)
    "outside-chunk": (lambda: KVStore(Affine(8, 64, "hadamard"), first=8), (5, 20), -8),
    # a batch's pages hold its sequences' first tokens: rows 3 to 10
    "batch-inside": (
        lambda: BatchKVStore([3, 3], Affine(8, 64, "hadamard"), first=8),
        (40, 20),
        3,
    ),
    "batch-short": (
        lambda: BatchKVStore([3, 3], Affine(8, 64, "hadamard"), first=8),
        (6,),
        3,
    ),
    # as the server prefills: each sequence's first tokens after its own
    # padding (None: one row per sequence), in the pages or held
    "batch-unequal": (
        lambda: BatchKVStore([3, 11], Affine(8, 64, "hadamard"), first=8),
        (40, 20),
        None,
    ),
    "batch-unequal-held": (
        lambda: BatchKVStore(
            [0, 21], Affine(4, 64, "hadamard"), center="kv", first=8, recent=16
        ),
        (12, 20),
        None,
    ),
}


@pytest.mark.parametrize("case", list(AFFINE_PREFILL))
def test_decoded_prefill_takes_first_tokens_outside_the_pages(case):
    """``affine_prefill.decoded_attention`` (MLX ops: it runs here) over
    the call a store makes: a sequence's first tokens, which its pages do
    not hold, in front of the dequantized copy; a batch's read in place of
    their copies in the pages; as the store's own attention (the MLX-ops
    loop here)."""
    make, lengths, first = AFFINE_PREFILL[case]
    s = make()
    queries, mask, call = prefilled(s, lengths, 20, seed=len(case))
    if first is None:
        exact = tuple(call.first[:4])
        assert exact[2].tolist() == s.left_padding.tolist()
    else:
        exact = first_as_int(call)
        assert exact[2] == first and exact[3] == s.spans.first
    recent = call.recent
    held = None if recent is None else (recent.keys, recent.values, recent.count)
    assert (held is not None) == case.endswith("-held")
    # (a batch's mask: the array over the pages' rows that hides its padding)
    out = decoded(call, mask=call.mask, exact=exact, held=held)
    want = s.scaled_dot_product_attention(queries, None, None, 0.125, mask)
    rows = past_padding(s, queries.shape[2])
    assert relative_error(out[:, :, rows], want[:, :, rows]) < 1e-5


@pytest.mark.parametrize("center", ["", "k"])
def test_decoded_prefill_takes_sinks(center):
    """Attention sinks (GPT-OSS) through the prefill over dequantized copies
    (``kernels._prefill``'s arguments: centered keys get their mean back so
    that a sink's logit meets the keys' own scores), as the MLX-ops loop."""
    codecs = (Affine(8, 64, "hadamard"), Affine(4, 64, "hadamard"))
    s = KVStore(*codecs, center=center, first=8)
    s.update_and_fetch(*random_kv(1, 2, 60, 64, seed=3, offset=2))
    queries = mx.random.normal((1, 6, 20, 64))
    sinks = mx.random.normal((6,)) * 3
    made = []
    kernels.register_attention(
        Kernel("test-capture", lambda call: made.append(call) or False, None)
    )
    try:
        want = s.scaled_dot_product_attention(
            queries, None, None, 0.125, "causal", sinks
        )
    finally:
        unregister("test-capture")
    call = made[0]
    assert backend._prefill_path(call) is None  # (no CUDA here)
    extra = {"mask": "causal", "exact": backend._first(call)}
    shift = backend._key_shift(call)
    out = decoded(call, **extra, sinks=call.sinks, key_shift=shift)
    assert relative_error(out, want) < 1e-5
    assert relative_error(decoded(call, **extra), want) > 1e-3


def test_decoded_prefill_in_blocks_of_queries(monkeypatch):
    """With a batch's array mask the scores are materialised: the queries
    go in blocks (here of 3 rows), with the same result."""
    s = BatchKVStore([3, 11], Affine(4, 64, "hadamard"), first=8)
    *_, call = prefilled(s, (40, 20), 20, seed=5)
    exact = tuple(call.first[:4])
    whole = decoded(call, mask=call.mask, exact=exact)
    monkeypatch.setattr(affine_prefill, "DECODED_SCORES", 3 * 2 * 6 * 60)
    blocks = decoded(call, mask=call.mask, exact=exact)
    rows = past_padding(s, 20)
    assert relative_error(blocks[:, :, rows], whole[:, :, rows]) < 1e-6


def test_affine_decode_helpers():
    assert affine_decode._mask_kind(None, 2, 10) == 0
    assert affine_decode._mask_kind("causal", 2, 10) == 0
    assert affine_decode._mask_kind(mx.ones((2, 1, 1, 10), mx.bool_), 2, 10) == 1
    assert affine_decode._mask_kind(mx.zeros((1, 1, 1, 10)), 2, 10) == 2
    # one row of keys per sequence or one for all, else not the kernel's
    assert affine_decode._mask_kind(mx.ones((3, 1, 1, 10), mx.bool_), 2, 10) is None
    assert affine_decode._mask_kind(mx.ones((2, 4, 1, 10), mx.bool_), 2, 10) is None
    assert affine_decode._mask_kind(mx.ones((2, 1, 1, 9), mx.bool_), 2, 10) is None
    # keys per block: a power of two from 128 to 1024
    assert affine_decode._decode_span(100, 8) == 128
    assert affine_decode._decode_span(32768, 32) == 1024
    assert affine_decode._decode_span(20000, 8) == 256
    # keys in each page, keys per block, blocks per page
    assert affine_decode._launch_layout(5000, [4096, 4096], 0, 8) == (
        [4096, 904],
        128,
        32,
    )
    assert affine_decode._launch_layout(5000, [4096], 4096, 8) == ([904], 128, 8)
    name = affine_decode.kernel_name("k", "code")
    assert name.startswith("k_") and name != affine_decode.kernel_name("k", "code ")
    constants = affine_decode._constants((("D", 64), ("R", True), ("T", mx.bfloat16)))
    assert constants.splitlines() == [
        "constexpr int D = 64;",
        "constexpr bool R = true;",
        "using T = __nv_bfloat16;",
    ]


# ---------------------------------------------------------------------------
# The codebook kernels' pure-Python parts


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


def test_the_kernels_take_three_to_five_bits_float16_norms_and_two_rotations():
    # the kernels write and read float16 norms: 8-bit ones take the ops path
    assert codebook_kernel._rotates(Codebook(3)) is True
    assert codebook_kernel._rotates(Codebook(5)) is True
    assert codebook_kernel._rotates(Codebook(4, "none")) is False
    assert codebook_kernel._rotates(Codebook(3, norm_bits=8)) is None
    assert codebook_kernel._rotates(Codebook(6)) is None
    assert codebook_kernel._rotates(Codebook(2)) is None
    assert codebook_kernel._rotates(Codebook(3, "givens")) is None
    assert codebook_kernel._rotates(Affine(4)) is None


def test_parts_of_the_codebook_kernels_switch_off_alone():
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


def test_the_decode_kernels_name_says_its_input_types():
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
    # compacted: comments go, no code does
    for extras in (False, True):
        name, inputs, outputs, decode = codebook_kernel._decode_kernel(2, extras)
        assert name == "codebook_sdpa_decode_2" + ("_x" if extras else "")
        assert ("key_weights" in inputs) == extras and "k_packed_1" in inputs
        assert len(outputs) == 5 and "PAGE_POINTERS" not in decode
        for source in (decode, codebook_kernel._COMBINE_SOURCE):
            compact = affine_decode._compact(source)
            assert "//" not in compact and len(compact) < 0.8 * len(source)
            code = [line.split("//")[0].split() for line in source.splitlines()]
            assert [w for words in code for w in words] == compact.split()


@pytest.mark.parametrize("mask", [None, "causal", "window", "additive"])
def test_blocked_attention_is_one_call_a_block_at_a_time(monkeypatch, mask):
    # the prefill's way past cuDNN (heads of 256): blocks of queries, each
    # with its rows of the mask (causal: the keys its last query sees)
    from mlx_lm.models.base import create_causal_mask

    mx.random.seed(3)
    q = mx.random.normal((1, 4, 40, 32))
    k, v = mx.random.normal((2, 1, 2, 100, 32))
    if mask == "window":
        mask = create_causal_mask(40, 60, window_size=16)
    elif mask == "additive":
        mask = mx.random.normal((1, 1, 40, 100))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    monkeypatch.setattr(attention, "TILE_SCORES", 4 * 100 * 7)
    got = codebook_kernel._blocked_attention(q, k, v, 0.2, mask)
    # (float32 matmuls are TF32 on CUDA: both calls are ~1e-3 off float64)
    atol = 2e-3 if ON_CUDA else 1e-5
    assert np.allclose(np.array(got), np.array(want), atol=atol)


def test_prefill_is_fused_only_where_cudnn_takes_it():
    assert codebook_kernel._fused(128, mx.bfloat16)
    assert not codebook_kernel._fused(256, mx.bfloat16)
    assert not codebook_kernel._fused(64, mx.float32)


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


@pytest.mark.parametrize("kept", [False, True])
def test_codebook_prefill_by_ops_attends_as_the_loop(kept):
    """``codebook.prefill_attention`` with its pages decoded by MLX ops (so
    it runs here): the decoded copies, the kept first tokens in place of
    theirs, and SDPA a block of queries at a time."""
    s = KVStore(Codebook(4), Codebook(3), first=8 if kept else 0, page_size=32)
    keys, values = random_kv(1, 2, 70, 64, seed=7)
    s.update_and_fetch(keys, values)
    queries = mx.random.normal((1, 6, 20, 64))
    call = call_of(s, queries, "causal")
    with codebook_kernel.decoding_by_ops():
        out = codebook_kernel.prefill_attention(
            call.queries,
            call.key_pages,
            call.value_pages,
            call.key_codec,
            call.value_codec,
            call.scale,
            "causal",
            call.length,
            kept=None if call.first is None else tuple(call.first[:4]),
        )
    assert relative_error(out, ops_attention(call)) < 1e-5


CODEBOOK_PREFILL = {
    "outside": (
        lambda: KVStore(Codebook(4), Codebook(3), first=8, page_size=32),
        (50, 20),
        -8,
    ),
    "outside-transform": (
        lambda: KVStore(
            Codebook(4), center="kv", key_scale="qk", first=16, page_size=32
        ),
        (5, 40, 20),
        -16,
    ),
    "outside-chunk": (lambda: KVStore(Codebook(4), first=8, page_size=32), (5, 20), -8),
    "batch-inside": (
        lambda: BatchKVStore([3, 3], Codebook(4), first=8, page_size=32),
        (40, 20),
        3,
    ),
    # the pages hold 3 of a batch's 8 first tokens yet
    "batch-short": (
        lambda: BatchKVStore([3, 3], Codebook(4), first=8, page_size=32),
        (6,),
        3,
    ),
}


@pytest.mark.parametrize("mask", ["causal", "bool", "additive"])
@pytest.mark.parametrize("case", list(CODEBOOK_PREFILL))
def test_codebook_prefill_by_ops_takes_first_tokens_outside_the_pages(case, mask):
    """``codebook.prefill_attention`` with its pages decoded by MLX ops (so
    it runs here) over the call a store makes: a sequence's first tokens,
    which its pages do not hold, in front of the decoded copy (a mask array,
    over the pages' rows, gets their columns: seen at or after their rows);
    a batch's in place of their copies; as the store's own attention (the
    MLX-ops loop here)."""
    make, lengths, first = CODEBOOK_PREFILL[case]
    s = make()
    queries, mask, call = prefilled(s, lengths, 20, seed=len(case), mask_kind=mask)
    kept = first_as_int(call)
    assert kept[2] == first and call.recent is None
    with codebook_kernel.decoding_by_ops():
        out = codebook_kernel.prefill_attention(
            call.weighted_queries(),
            call.key_pages,
            call.value_pages,
            call.key_codec,
            call.value_codec,
            call.scale,
            call.mask,
            call.length,
            kept=kept,
        )
    want = s.scaled_dot_product_attention(queries, None, None, 0.125, mask)
    rows = past_padding(s, queries.shape[2])
    assert relative_error(call.uncenter(out)[:, :, rows], want[:, :, rows]) < 1e-5


def test_the_codebook_kernels_stay_out_of_the_way_off_cuda():
    s = KVStore(3)
    k = mx.random.normal((1, 2, 40, 64))
    s.update_and_fetch(k, k)
    q = mx.random.normal((1, 4, 1, 64))
    args = (q, s.key_pages, s.value_pages, s.key_codec, s.value_codec)
    if not ON_CUDA:
        assert not codebook_kernel.encodes(k, s.key_codec)
        assert not codebook_kernel.holds(k, k, s.key_codec, s.value_codec)
        assert codebook_kernel.attention(*args, 0.125, None, None, 40) is None
    with codebook_kernel.disabled():
        assert not codebook_kernel.applies(*args, None, None, 40)
    # givens, affine and debiased codecs are never taken
    for codecs in (
        (Codebook(3, "givens"),) * 2,
        (Codebook(3), Affine(4, 64, "hadamard")),
        (Codebook(3, debias=True), Codebook(3)),
    ):
        other = KVStore(*codecs)
        other.update_and_fetch(k, k)
        args = (q, other.key_pages, other.value_pages, *codecs)
        assert not codebook_kernel.applies(*args, None, None, 40)
    # nor a call without pages (a residual not yet written)
    assert not backend._codebook_applies(Call(q, 0.1, None, None, *codecs, [], [], 0))


# ---------------------------------------------------------------------------
# On CUDA: each kernel against the MLX-ops reference


def _compare(store, queries, mask, atol=5e-3, sinks=None):
    """The store's attention through the kernels and through the ops loop,
    the MLX-ops reference (both read held decode tokens unquantized)."""
    out = store.scaled_dot_product_attention(queries, None, None, 0.1, mask, sinks)
    with kernels.disabled():
        ref = store.scaled_dot_product_attention(queries, None, None, 0.1, mask, sinks)
    assert out.dtype == queries.dtype
    assert relative_error(out, ref) < atol
    return out, ref


@cuda_only
@pytest.mark.parametrize(
    "bits,dim,rotation",
    itertools.product([3, 4, 5], [64, 128, 256], ["hadamard", "none"]),
)
def test_cuda_encode_and_dequantize_kernels(bits, dim, rotation):
    codec = Codebook(bits, rotation)
    x = (mx.random.normal((2, 4, 33, dim)) * 3).astype(mx.float16)
    assert codebook_kernel.encodes(x, codec)
    packed, norms = codec.encode(x)
    with kernels.disabled():
        ref_packed, ref_norms = codec.encode(x)
    ref = codebook_kernel.dequantize_by_ops((ref_packed, ref_norms), codec, mx.float32)
    # the rotations round differently (the ops path in TF32 on CUDA): a
    # coordinate next to a cell edge may move
    from omlx_cache.kv.codebook import unpack

    assert (unpack(packed, bits) == unpack(ref_packed, bits)).mean().item() > 0.995
    assert relative_error(norms, ref_norms) < 1e-2
    out = codebook_kernel.dequantize((ref_packed, ref_norms), codec, mx.float32)
    assert relative_error(out, ref) < 1e-3


CUDA_CASES = [
    # key codec, value codec, (q heads, kv heads), head dim, tokens, page, settings
    (Codebook(3), Codebook(3), (32, 8), 128, 4097, 4096, {}),
    # (a transform needs first tokens: 2, the fewest)
    (Codebook(4), Codebook(3), (9, 3), 64, 777, 256, {"center": "k", "first": 2}),
    (Codebook(5), Codebook(4), (16, 4), 256, 2500, 1024, {"center": "kv", "first": 2}),
    (Codebook(3), Codebook(3), (32, 8), 128, 2100, 1000, {}),
    (Codebook(4), Codebook(3), (9, 3), 64, 777, 256, {"first": 5, "key_scale": "q"}),
    (Codebook(3), Codebook(3), (8, 2), 64, 4200, 128, {"first": 4}),
    (Affine(8), Affine(4), (32, 8), 128, 4097, 4096, {}),
    (Affine(4, 64, "hadamard"), Affine(4, 32, "hadamard"), (9, 3), 64, 777, 256, {}),
    (Affine(8), Affine(8), (16, 2), 256, 2000, 1024, {"first": 16}),
    (
        Affine(4, 64, "hadamard"),
        Affine(2, 32, "hadamard"),
        (8, 8),
        128,
        900,
        4096,
        {"center": "k", "key_scale": "qk", "first": 8},
    ),
]


@cuda_only
@pytest.mark.parametrize("case", range(len(CUDA_CASES)))
def test_cuda_attention_kernels_against_the_ops_loop(case):
    """Prefill (33 queries, causal), then decode steps whose tokens the
    kernels hold: each against the MLX-ops loop."""
    key_codec, value_codec, (n_q, n_kv), D, tokens, page, settings = CUDA_CASES[case]
    mx.random.seed(tokens)
    s = KVStore(key_codec, value_codec, page_size=page, **settings)
    k = mx.random.normal((1, n_kv, tokens + 13, D)).astype(mx.float16)
    v = mx.random.normal((1, n_kv, tokens + 13, D)).astype(mx.float16)
    s.update_and_fetch(k[:, :, :tokens], v[:, :, :tokens])
    q = mx.random.normal((1, n_q, 33, D)).astype(mx.float16)
    _compare(s, q, "causal")
    for t in range(tokens, tokens + 13):
        s.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        if t - tokens in (0, 5, 12):
            q1 = mx.random.normal((1, n_q, 1, D)).astype(mx.float16)
            _compare(s, q1, None)
    assert s.spans.n_held > 0  # the decode kernels held the tokens


@cuda_only
@pytest.mark.parametrize("codecs", [(3, 3), (Affine(8), Affine(4))])
@pytest.mark.parametrize("first", [0, 8])
def test_cuda_batched_decode_with_left_padding(codecs, first):
    """Each left-padded sequence keeps its first tokens after its padding:
    the decode kernels read each sequence's own, as the ops loop does."""
    padding = [0, 100, 777]
    # (centered where first tokens are kept: a transform needs them)
    s = BatchKVStore(padding, *codecs, center="kv" if first else "", first=first)
    k = mx.random.normal((3, 8, 1500, 128)).astype(mx.float16)
    s.update_and_fetch(k, k * 0.5)
    token = mx.random.normal((3, 8, 1, 128)).astype(mx.float16)
    mask = s.make_mask(1)
    s.update_and_fetch(token, token)
    q = mx.random.normal((3, 32, 1, 128)).astype(mx.float16)
    _compare(s, q, mask)
    additive = mx.where(mask, 0.0, -1e9).astype(mx.float16)
    _compare(s, q, additive)


@cuda_only
def test_cuda_prefill_over_heads_of_256_scores_in_float32():
    # cuDNN takes heads up to 128; past it MLX's scores would be bfloat16
    # (Gemma's passkeys went missing): the prefill attends in float32
    from mlx_lm.models.base import create_causal_mask

    mx.random.seed(7)
    s = KVStore(4, page_size=1024, center="k", first=8)
    k, v = (mx.random.normal((2, 1, 1, 3000, 256)) * 3).astype(mx.bfloat16)
    s.update_and_fetch(k, v)
    q = (mx.random.normal((1, 4, 300, 256)) * 3).astype(mx.bfloat16)
    mask = create_causal_mask(300, 2700, window_size=512)[None, None]
    out, ref = _compare(s, q, mask)
    with codebook_kernel.prefill_in(mx.bfloat16):
        bf16 = s.scaled_dot_product_attention(q, None, None, 0.1, mask)
    assert relative_error(bf16, ref) > 2 * relative_error(out, ref)


@cuda_only
def test_cuda_decode_steps_share_one_plan():
    """A decode step's launches are planned once per kind of call: the steps
    after the first find their plan (host time a decode layer pays)."""
    s = KVStore(3, page_size=4096)
    k = mx.random.normal((1, 8, 600, 128)).astype(mx.float16)
    s.update_and_fetch(k, k)
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.float16)

    def step():
        t = mx.random.normal((1, 8, 1, 128)).astype(mx.float16)
        s.update_and_fetch(t, t)
        out = s.scaled_dot_product_attention(q, None, None, 0.1, None)
        mx.eval(out, s.spans.held_keys)

    step()
    step()
    hits = codebook_kernel._decode_plan.cache_info().hits
    for _ in range(3):
        step()
    assert codebook_kernel._decode_plan.cache_info().hits == hits + 3
    assert s.spans.n_held == 5


# ---------------------------------------------------------------------------
# The GPU check scripts, dry


SCRIPTS = {
    "codebook_kernel_check": ("attention", "batched"),
    "decode_kernel_check": ("correctness",),
    "prefill_kernel_check": ("correctness", "ops"),
    "decode_mask_check": ("rows",),
}


@pytest.mark.skipif(ON_CUDA, reason="a dry run is the CPU's")
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_gpu_check_scripts_run_dry(name, tmp_path):
    """scripts/gpu's kernel checks run on the CPU with --dry-run: small
    shapes through the MLX-ops loop (the kernels' path is the loop here),
    their JSON written; without it they stop (no CUDA)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / f"{name}.py"
    out = tmp_path / "check.json"
    run = [sys.executable, str(script), "--out", str(out)]
    subprocess.run([*run, "--dry-run"], check=True, capture_output=True)
    report = json.loads(out.read_text())
    assert report["dry_run"] and report["kernels"] == NAMES
    for part in SCRIPTS[name]:
        rows = report[part]
        assert rows and all(row.get("kernel_vs_ops", 0) == 0 for row in rows)
        assert all(row.get("kernel_rel_err", 0) < 0.01 for row in rows)
    stopped = subprocess.run(run, check=False, capture_output=True, text=True)
    assert stopped.returncode != 0 and "no CUDA device" in stopped.stderr
