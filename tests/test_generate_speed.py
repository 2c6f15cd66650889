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
    argv += ["--schemes", "fp16", "8,4", "8,4/r0", "8,4/h0", "--tokens", "4"]
    argv += ["--warmup", "64", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    generate_speed.main()
    report = json.loads(out.read_text())
    rows = {r["scheme"]: r for r in report["rows"]}
    # the first run of each scheme (its kernels' compile on a fresh machine)
    assert [r["scheme"] for r in report["warmup"]] == list(rows)
    assert all(r["total_s"] >= r["first_token_s"] > 0 for r in report["warmup"])
    assert list(rows) == ["fp16", "8,4", "8,4/r0", "8,4/h0"]
    for r in rows.values():
        assert r["decode_tok_s"] > 0 and r["first_token_s"] > 0
        assert r["decode_tok_s_all_steps"] > 0 and r["decode_all_steps_vs_fp16"] > 0
    # generate_step reserves the prompt and max_tokens in one page; unreserved,
    # 4,200 tokens take two 4,096-token pages
    assert rows["8,4"]["pages"] == rows["8,4/h0"]["pages"] == 1
    assert rows["8,4/r0"]["pages"] == 2
    assert rows["fp16"]["pages"] is None and rows["8,4"]["decode_vs_fp16"] > 0


def test_bad_scheme_option(generate_speed):
    with pytest.raises(ValueError, match="unknown scheme options"):
        generate_speed.parse("8,4/z1")
    with pytest.raises(ValueError, match="unknown scheme options"):
        generate_speed.parse("8,4/xa")


def test_kept_and_residual_options(generate_speed):
    assert generate_speed.parse("8,4/x16/res64") == ((8, 4), None, None, 16, 64)
    assert generate_speed.parse("4") == (4, None, None, 0, 0)
    assert generate_speed.parse("codebook-3/slices") == (None, None, None, 0, 0)
    assert generate_speed.parse("4/x4/nocopy") == (4, None, None, 4, 0)
