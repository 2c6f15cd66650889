"""``python -m omlx_cache.generate``: a scheme by name through mlx-lm's own
generation, on the real converted SmolLM2."""

import pytest

from omlx_cache import generate as kv_generate


@pytest.fixture(scope="module")
def model_dir(smollm2_dirs):
    return str(smollm2_dirs[1])


def run(model_dir, *options):
    argv = ["--model", model_dir, "--prompt", "Name three primary colors."]
    return kv_generate.main([*argv, "--max-tokens", "12", *options])


def test_scheme_generates_what_fp16_does(model_dir, capsys):
    reference = run(model_dir)
    assert reference.strip()
    assert run(model_dir, "--kv", "q4") == reference
    assert run(model_dir, "--kv", "8", "--max-kv-size", "64") == reference
    assert "Generation:" in capsys.readouterr().out


def test_bad_scheme_is_named(model_dir, capsys):
    with pytest.raises(SystemExit):
        run(model_dir, "--kv", "bits=4 centre=k")
    assert "Unknown scheme item 'centre'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run(model_dir, "--max-tokens", "0")
