"""``omlx_cache.fit``: per-model profiles of the layers a ``fit=`` scheme gives
more bits, on a tiny random llama."""

import json

import numpy as np
import pytest
from test_eval import model_and_text
from tiny_llama import CONFIG, make_model

from omlx_cache import eval as kv_eval
from omlx_cache import fit
from omlx_cache.kv.spec import KVSpec, layer_shapes


@pytest.fixture(scope="module")
def model():
    return make_model()


def test_measured_spec():
    spec = KVSpec.parse("bits=4 more=k8 fit=5")
    assert fit.measured_spec(spec) == KVSpec.parse("bits=4,16")
    both = KVSpec.parse("bits=4 more=kv8 fit=5")
    assert fit.measured_spec(both) == KVSpec.parse("bits=4")


def test_layer_errors_and_budget(model):
    tokens = np.random.default_rng(0).integers(2, CONFIG["vocab_size"], size=200)
    windows = kv_eval.make_windows(tokens.tolist(), 1, 96, bos=1)
    errors = fit.layer_errors(model, windows, KVSpec.parse("bits=4 first=0"), chunk=32)
    assert len(errors) == 2 and all(e > 0 for e in errors)
    shapes = layer_shapes(model)
    spec = KVSpec.parse("bits=4 first=0 more=k8 fit=5")
    first = fit.ranked(errors)[0]
    # one layer's keys at 8 bits: (8.5 + 4.5) / 2 in it, 4.5 in the other
    assert fit.layers_within(spec, errors, shapes, 5.5) == [first]
    assert fit.layers_within(spec, errors, shapes, 6.5) == [0, 1]
    assert fit.layers_within(spec, errors, shapes, 4.5) == []
    with pytest.raises(ValueError, match="4.500 bits per element without more bits"):
        fit.layers_within(spec, errors, shapes, 4.4)


def test_resolve_keeps_a_profile(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMLX_CACHE_HOME", str(tmp_path))
    spec = KVSpec.parse("bits=4 first=0 more=k8 fit=5.5")
    assert fit.resolve(KVSpec.parse("4"), model) == KVSpec.parse("4")
    chosen = fit.resolve(spec, model)
    assert len(chosen.layers) == 1 and chosen.fit is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "512 sampled tokens" in err[0]
    (profile,) = (tmp_path / "profiles").glob("*.json")
    report = json.loads(profile.read_text())
    assert report["layers"] == list(chosen.layers) and report["scheme"] == chosen.text
    # kept in memory, then on disk
    assert fit.resolve(spec, model) == chosen
    fit._fitted.clear()
    assert fit.resolve(spec, model) == chosen
    assert capsys.readouterr().err == ""
    profile.write_text("{not json")
    fit._fitted.clear()
    assert fit.resolve(spec, model) == chosen
    assert "ignoring" in capsys.readouterr().err


def test_main(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMLX_CACHE_HOME", str(tmp_path))
    argv = model_and_text(tmp_path, model)[:2]
    report = fit.main([*argv, "--kv", "bits=4 first=0 more=k8 fit=5.5"])
    assert report["bits"] <= 5.5 and len(report["layers"]) == 1
    assert "bits per element at 4096 tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        fit.main([*argv, "--kv", "8,4"])
    assert "has no fit=" in capsys.readouterr().err
