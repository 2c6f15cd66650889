"""Helpers shared by the tests of ``omlx_cache.kv``: random fills, a float32
reference over what a store holds, and errors."""

import mlx.core as mx

from omlx_cache.kv.rotation import rotate


def relative_error(out, ref):
    """Largest absolute difference over the reference's largest magnitude."""
    out, ref = out.astype(mx.float32), ref.astype(mx.float32)
    return ((out - ref).abs().max() / ref.abs().max()).item()


def random_kv(batch, n_kv, length, dim, seed=None, offset=0.0):
    """Random keys and values (B, n_kv, length, dim); ``offset``: a common
    part of that size per head, as real keys have."""
    if seed is not None:
        mx.random.seed(seed)
    keys = mx.random.normal((batch, n_kv, length, dim))
    values = mx.random.normal((batch, n_kv, length, dim))
    if offset:
        common = offset * mx.random.normal((batch, n_kv, 1, dim))
        keys, values = keys + common, values + common
    return keys, values


def fill(store, n_kv, length, new, head_dim, batch=1):
    """Write ``length`` random tokens, the last ``new`` in a separate update;
    return the keys and values written."""
    keys, values = random_kv(batch, n_kv, length, head_dim)
    if length > new:
        store.update_and_fetch(keys[..., :-new, :], values[..., :-new, :])
    store.update_and_fetch(keys[..., -new:, :], values[..., -new:, :])
    return keys, values


def attend(store, queries, mask, sinks=None, scale=None):
    """The store's attention (as mlx-lm's models call it)."""
    scale = queries.shape[-1] ** -0.5 if scale is None else scale
    return store.scaled_dot_product_attention(
        queries, None, None, scale=scale, mask=mask, sinks=sinks
    )


def codec_round(codec, x):
    """``x`` as ``codec`` stores it: encoded, decoded and rotated back (float32)."""
    decoded = codec.decode(codec.encode(x), mx.float32)
    return rotate(decoded, codec.rotation, inverse=True)


def stored(store):
    """What a store's attention reads, in float32, as the model gave it: the
    pages decoded (rows ``dropped`` on), each sequence's first tokens as the
    first span keeps them, the recent or held tokens as held, rotated back,
    keys unweighted and uncentered, values uncentered. A pending write (the
    one that completes the first tokens) is written, the transform fixed
    with the queries seen so far, and an incoming held token landed. (Page
    rows of the first tokens, written before the transform was fixed, are
    read from the first span, as attention reads them.)"""
    kc, vc = store.key_codec, store.value_codec
    spans = store.spans
    store._flush_pending()
    spans.land(store._prepare_held)
    length = store._written - store.dropped
    parts = []
    for codec, pages in ((kc, store.key_pages), (vc, store.value_pages)):
        decoded = [codec.decode(page, mx.float32) for page in pages]
        if decoded:
            parts.append(mx.concatenate(decoded, axis=2)[:, :, :length])
        else:  # every token held (a residual not yet full)
            held = spans.held_keys if codec is kc else spans.held_values
            parts.append(held[:, :, :0].astype(mx.float32))
    keys, values = parts
    if spans.first_keys is not None:
        padding = store.left_padding_array().tolist()
        # a KVStore's sequences (any batch size) all start at row 0
        rows = [slice(i, i + 1) for i in range(len(padding))]
        if len(padding) == 1:
            rows = [slice(None)]
        for i, pad in zip(rows, padding):
            lo = pad - store.dropped
            n = min(spans.first, keys.shape[2] - lo)
            if lo >= 0 and n > 0:
                keys[i, :, lo : lo + n] = spans.first_keys[i, :, :n]
                values[i, :, lo : lo + n] = spans.first_values[i, :, :n]
    if spans.n_held:
        held = [
            x[:, :, : spans.n_held].astype(mx.float32)
            for x in spans.recent_tokens()[:2]
        ]
        if not spans.rotated:
            held = [rotate(held[0], kc.rotation), rotate(held[1], vc.rotation)]
        keys = mx.concatenate([keys, held[0]], axis=2)
        values = mx.concatenate([values, held[1]], axis=2)
    keys = rotate(keys, kc.rotation, inverse=True)
    values = rotate(values, vc.rotation, inverse=True)
    transform = store.transform
    if transform.key_weights is not None:
        keys = keys / transform.key_weights
    if transform.key_mean is not None:
        keys = keys + transform.key_mean
    if transform.value_mean is not None:
        values = values + transform.value_mean
    return keys, values


def float_attention(queries, keys, values, mask=None, sinks=None, scale=None):
    """float32 attention (mx.fast) over ``keys`` and ``values``."""
    scale = queries.shape[-1] ** -0.5 if scale is None else scale
    f32 = [x.astype(mx.float32) for x in (queries, keys, values)]
    return mx.fast.scaled_dot_product_attention(
        *f32, scale=scale, mask=mask, sinks=sinks
    )


def reference(store, queries, mask, sinks=None, scale=None):
    """float32 attention over what the store holds (``stored``)."""
    return float_attention(queries, *stored(store), mask, sinks, scale)
