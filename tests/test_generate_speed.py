"""scripts/gpu/generate_speed.py on the CPU: generate_step over each KV scheme."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def generate_speed():
    spec = importlib.util.spec_from_file_location(
        "generate_speed", ROOT / "scripts/gpu/generate_speed.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows(generate_speed, tmp_path, monkeypatch):
    out = tmp_path / "speed.json"
    argv = ["generate_speed.py", "--preset", "tiny-cpu", "--contexts", "4200"]
    argv += ["--schemes", "fp16", "8,4", "8,4/ops", "upstream-8", "--tokens", "4"]
    argv += ["--warmup", "64", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    generate_speed.main()
    report = json.loads(out.read_text())
    rows = {r["scheme"]: r for r in report["rows"]}
    # the first run of each scheme (its kernels' compile on a fresh machine)
    assert [r["scheme"] for r in report["warmup"]] == list(rows)
    assert all(r["total_s"] >= r["first_token_s"] > 0 for r in report["warmup"])
    assert list(rows) == ["fp16", "8,4", "8,4/ops", "upstream-8"]
    for r in rows.values():
        assert r["decode_tok_s"] > 0 and r["first_token_s"] > 0
        assert r["decode_tok_s_all_steps"] > 0 and r["decode_all_steps_vs_fp16"] > 0
    # the stores reserve the prompt and max_tokens in one page, as
    # generate_step reserves them
    assert rows["8,4"]["pages"] == rows["8,4/ops"]["pages"] == 1
    assert rows["fp16"]["pages"] is None and rows["8,4"]["decode_vs_fp16"] > 0


def test_bad_scheme(generate_speed):
    with pytest.raises(ValueError, match="Unknown scheme item"):
        generate_speed.make_cache(None, "bits=4 rotat=k", 64, 4)
