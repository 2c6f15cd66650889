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


def front(store):
    """Rows before the pages that attention reads from the first span: a
    sequence's first tokens, which its store holds there only (rows 0 to
    this; a batch's pages hold every row but those a window dropped)."""
    spans = store.spans
    if spans.first_keys is None or store._is_batch():
        return 0
    return min(spans.first, store.dropped)


def stored(store):
    """What a store's attention reads, in float32, as the model gave it: the
    first tokens the pages do not hold (``front``) as the first span keeps
    them, then the pages decoded (rows ``dropped`` on; a batch's first
    tokens as the first span keeps them), then the recent or held tokens as
    held, rotated back, keys unweighted and uncentered, values uncentered. A
    pending write (the one that completes the first tokens) is written, the
    transform fixed with the queries seen so far, and an incoming held token
    landed. (A window that dropped pages leaves a gap between the first
    tokens and the pages.)"""
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
        else:  # no page rows (every token held, or in the first span)
            like = spans.held_keys if spans.n_held else spans.first_keys
            if codec is vc:
                like = spans.held_values if spans.n_held else spans.first_values
            parts.append(like[:, :, :0].astype(mx.float32))
    keys, values = parts
    if spans.first_keys is not None and store._is_batch():
        # each sequence's first tokens at rows left_padding[i] on
        for i, pad in enumerate(store.left_padding_array().tolist()):
            lo = pad - store.dropped
            n = min(spans.first, keys.shape[2] - lo)
            if lo >= 0 and n > 0:
                keys[i, :, lo : lo + n] = spans.first_keys[i, :, :n]
                values[i, :, lo : lo + n] = spans.first_values[i, :, :n]
    n = front(store)
    if n:
        keys = mx.concatenate([spans.first_keys[:, :, :n].astype(mx.float32), keys], 2)
        values = mx.concatenate(
            [spans.first_values[:, :, :n].astype(mx.float32), values], 2
        )
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
    return store.transform.undo(keys, values)


def stored_mask(store, mask, L):
    """``mask`` (over the rows the store attends, or made before the write:
    more columns, read right-aligned as the store reads them) for ``stored``'s
    rows: the ``front`` ones in front, seen by a query at or after their row
    (and, in a window, within it or among its sinks). Strings and None as
    they are (``mx.fast`` aligns "causal" at the end)."""
    if not isinstance(mask, mx.array):
        return mask
    columns = store._idx - store.dropped
    if mask.shape[-1] > columns:
        mask = mask[..., mask.shape[-1] - columns :]
    n = front(store)
    if not n:
        return mask
    while mask.ndim < 4:
        mask = mask[None]
    q = mx.arange(store._idx - L, store._idx)[:, None]
    rows = mx.arange(n)[None]
    visible = rows <= q
    if store.window is not None:
        visible = visible & (
            (q - rows < store.window - store.keep) | (rows < store.keep)
        )
    if mask.dtype != mx.bool_:
        visible = mx.where(visible, 0.0, -float("inf")).astype(mask.dtype)
    mask = mx.broadcast_to(mask, (*mask.shape[:2], L, mask.shape[-1]))
    visible = mx.broadcast_to(visible, (*mask.shape[:3], n))
    return mx.concatenate([visible, mask], axis=-1)


def float_attention(queries, keys, values, mask=None, sinks=None, scale=None):
    """float32 attention (mx.fast) over ``keys`` and ``values``."""
    scale = queries.shape[-1] ** -0.5 if scale is None else scale
    f32 = [x.astype(mx.float32) for x in (queries, keys, values)]
    return mx.fast.scaled_dot_product_attention(
        *f32, scale=scale, mask=mask, sinks=sinks
    )


def reference(store, queries, mask, sinks=None, scale=None):
    """float32 attention over what the store holds (``stored``)."""
    keys, values = stored(store)
    mask = stored_mask(store, mask, queries.shape[2])
    return float_attention(queries, keys, values, mask, sinks, scale)
