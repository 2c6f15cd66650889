"""Helpers shared by the tests of caches that attend over their own storage."""

import mlx.core as mx


def fill(cache, n_kv, length, new, head_dim, batch=1):
    """Write ``length`` random tokens, the last ``new`` in a separate update;
    return what that update returned."""
    keys = mx.random.normal((batch, n_kv, length, head_dim))
    values = mx.random.normal((batch, n_kv, length, head_dim))
    if length > new:
        cache.update_and_fetch(keys[..., :-new, :], values[..., :-new, :])
    return cache.update_and_fetch(keys[..., -new:, :], values[..., -new:, :])


def relative_error(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()
