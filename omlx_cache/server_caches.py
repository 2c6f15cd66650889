"""KV cache schemes for ``mlx_lm.server``, through its ``--kv-cache`` hook.

    python -m mlx_lm.server --model models/gemma-3-270m --kv-cache omlx \\
        --kv-cache-config q4

``--kv-cache omlx`` (this package's entry point in the group
``mlx_lm.kv_caches``) makes every request's cache from the scheme that
``--kv-cache-config`` names, ``q4`` by default (``q4-recall`` and ``cq4``
find more passkeys; ``cq4`` fits its layers to the model when it loads,
once: docs/results.md): a preset or any string
``python -m omlx_cache.eval`` takes, with ``--kv-group-size`` and
``--max-kv-size`` applied as there. The server batches requests whose caches
merge; caches with weighted keys (all three presets) or a recent window are
served one request at a time. A centered or weighted cache takes its means
and weights from its first write: a request that continues a cached prefix
keeps the prefix's (a short system prompt's, say).
"""

from . import schemes

DEFAULT_SCHEME = "q4"


def from_args(args):
    """The entry point: ``make_cache(model, max_kv_size)`` for the scheme that
    mlx_lm.server's arguments name."""
    name = args.kv_cache_config or DEFAULT_SCHEME
    try:
        scheme = schemes.get_scheme(name, args.kv_group_size)
    except ValueError as e:
        raise ValueError(f"--kv-cache-config {name}: {e}") from None

    def make_cache(model, max_kv_size=None):
        if max_kv_size is None:
            return scheme.make_cache(model)
        return schemes.windowed(scheme, max_kv_size).make_cache(model)

    return make_cache
