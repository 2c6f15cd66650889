"""Backend kernels for ``omlx_cache.kv``: each module registers itself with
``omlx_cache.kv.kernels`` when imported (here)."""
