"""``omlx_cache.server_caches``, the ``omlx`` KV cache factory that
``mlx_lm.server --kv-cache`` loads, and the scheme presets it defaults to."""

import argparse
import importlib.metadata
import itertools
import json

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from test_server_real import QUESTIONS
from tiny_gemma import tiny_gemma

from omlx_cache import schemes, server_caches
from omlx_cache.center import CenteredQuantizedKVCache, CenteredQuantizedRotatingKVCache


@pytest.fixture(scope="module")
def smollm2(smollm2_dirs):
    return load(str(smollm2_dirs[1]))


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


def test_default_scheme_is_q4(smollm2):
    model, _ = smollm2
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


def test_reused_prefix_answers_as_a_fresh_cache(smollm2):
    """The server trims a cached prompt to the prefix the next request shares
    with it: q4's recent tokens stay held through the trim (patch 0025), so
    every question answers as from a fresh cache, whichever came before."""
    model, tokenizer = smollm2
    scheme = schemes.get_scheme("q4")

    def answer(prompt, cache):
        steps = generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=8)
        return [int(token) for token, _ in steps]

    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    fresh = [answer(p, scheme.make_cache(model)) for p in prompts]
    for before, after in itertools.permutations(range(len(prompts)), 2):
        a, b = prompts[before], prompts[after]
        shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        cache = scheme.make_cache(model)
        answer(a, cache)
        for c in cache:
            c.trim(c.offset - shared)
        assert answer(b[shared:], cache) == fresh[after], (before, after)


CQ4_SMOLLM2 = (
    "codebook-4+center+qscale+exact8"
    "+k5@1.2.3.8.9.10.11.12.13.14.16.17.18.19.21.22.23.26"
)


def test_calibrated_codebook_scheme_serves(smollm2):
    """CQ4, as `omlx_cache.layers --budget 4.6` printed it for SmolLM2 (the
    README's serve command): 5-bit keys in the listed layers, 4-bit values
    everywhere, within the budget, and it answers through the server's
    factory as fp16 KV does."""
    from omlx_cache import layers
    from omlx_cache.codebook import CodebookKVCache

    model, tokenizer = smollm2
    caches = server_caches.from_args(server_args(CQ4_SMOLLM2))(model)
    high = {1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 16, 17, 18, 19, 21, 22, 23, 26}
    assert all(type(c) is CodebookKVCache for c in caches)
    assert [c.key_codec.bits for c in caches] == [
        5 if i in high else 4 for i in range(len(caches))
    ]
    assert {c.value_codec.bits for c in caches} == {4}
    assert all(c.keep_exact == 8 and c.center == "k" and c.key_scale for c in caches)
    assert layers.scheme_bits(model, CQ4_SMOLLM2) == pytest.approx(4.589, abs=1e-3)

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[2]}], add_generation_prompt=True
    )

    steps = generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=12)
    served = tokenizer.decode([int(token) for token, _ in steps])
    steps = generate_step(mx.array(prompt), model, max_tokens=12)
    assert served == tokenizer.decode([int(token) for token, _ in steps])
    assert "4" in served


def test_cq4_fits_its_layers_when_the_server_loads(tmp_path, monkeypatch, capsys):
    """``--kv-cache-config cq4`` on a Gemma-like model: 5-bit keys in the
    layers fitted within 4.6 bits on text the model samples, once (a second
    factory reads the fit)."""
    from omlx_cache import layers

    monkeypatch.setenv("OMLX_CACHE_HOME", str(tmp_path))
    model = tiny_gemma()
    caches = server_caches.from_args(server_args("cq4"))(model)
    # on text as long as its 16-token windows (layers.fit_tokens)
    err = capsys.readouterr().err
    assert "fitting codebook-4+center+qscale+exact8 " in err
    assert "16 sampled tokens" in err
    assert [c.value_codec.bits for c in caches] == [4, 4, 4]
    (fit,) = (tmp_path / "layers").glob("*.json")
    chosen = layers.with_layers(
        "codebook-4+center+qscale+exact8",
        [i for i, c in enumerate(caches) if c.key_codec.bits == 5],
        5,
    )
    assert json.loads(fit.read_text())["scheme"] == chosen
    assert layers.scheme_bits(model, chosen) <= 4.6
    layers._fitted.clear()
    server_caches.from_args(server_args("cq4"))(model)
    assert "fitting" not in capsys.readouterr().err
