"""``omlx_cache.server_caches``, the ``omlx`` KV cache factory that
``mlx_lm.server --kv-cache`` loads, and the scheme presets it defaults to."""

import argparse
import importlib.metadata

import pytest
from mlx_lm import load
from test_center_key_scale import tiny_gemma

from omlx_cache import schemes, server_caches
from omlx_cache.center import CenteredQuantizedKVCache, CenteredQuantizedRotatingKVCache


def server_args(config=None, group_size=64):
    return argparse.Namespace(kv_cache_config=config, kv_group_size=group_size)


def test_presets_name_their_schemes():
    for name, spelled in schemes.PRESETS.items():
        preset, scheme = schemes.get_scheme(name), schemes.get_scheme(spelled)
        assert preset.name == spelled
        assert preset.bits_per_element == scheme.bits_per_element
    assert "q4-recall" in schemes.known_forms()


def test_entry_point_is_installed():
    (entry,) = importlib.metadata.entry_points(group="mlx_lm.kv_caches", name="omlx")
    assert entry.load() is server_caches.from_args


def test_default_scheme_is_q4(smollm2_dirs):
    model, _ = load(str(smollm2_dirs[1]))
    caches = server_caches.from_args(server_args())(model)
    assert all(type(c) is CenteredQuantizedKVCache for c in caches)
    assert all(c.key_scale and c.keep_exact == 8 and c.residual == 72 for c in caches)
    assert all(c.bits == (4, 3) and c.rotate for c in caches)


def test_max_kv_size_bounds_the_unbounded_layers_only():
    make_cache = server_caches.from_args(server_args("q4-recall"))
    plain = make_cache(tiny_gemma())
    bounded = make_cache(tiny_gemma(), 64)
    windows = [getattr(c, "max_size", None) for c in plain]
    assert None in windows and any(windows)
    for window, after in zip(windows, bounded):
        assert type(after) is CenteredQuantizedRotatingKVCache
        # a sliding-window layer keeps its own window
        assert after.max_size == (window or 64)


def test_bad_scheme_is_named():
    with pytest.raises(ValueError, match="--kv-cache-config 4\\+centre: Unknown"):
        server_caches.from_args(server_args("4+centre"))
