"""scripts/gpu on the CPU: batch_speed (BatchGenerator over each KV scheme),
random_model and arch_check."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_rows(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "batch_speed", ROOT / "scripts/gpu/batch_speed.py"
    )
    batch_speed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(batch_speed)
    out = tmp_path / "batch.json"
    argv = ["batch_speed.py", "--preset", "tiny-cpu", "--batches", "1x300,3x300"]
    argv += ["--schemes", "fp16", "4", "--tokens", "4", "--jitter", "40"]
    argv += ["--warmup", "1x64", "--fp16-max-tokens", "600", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    batch_speed.main()
    report = json.loads(out.read_text())
    assert [r["scheme"] for r in report["cold_start"]] == ["fp16", "4"]
    rows = [(r["batch"], r["scheme"]) for r in report["rows"]]
    # fp16's 3 x 300 (840 tokens) is past --fp16-max-tokens
    assert rows == [("1x300", "fp16"), ("1x300", "4"), ("3x300", "4")]
    _, alone, three = report["rows"]
    assert three["prompt_tokens"] == 300 + 260 + 220
    assert alone["prefill_vs_fp16"] > 0 and "prefill_vs_alone" in three
    # every batch's first call (kernel compiles) is timed apart
    assert alone["first_call_prefill_s"] > 0 and three["first_call_prefill_s"] > 0
    assert all(r["decode_tok_s"] > 0 and r["prefill_s"] > 0 for r in report["rows"])
    assert all(0 < r["step_ms_median"] <= r["step_ms_p90"] for r in report["rows"])
    assert alone["step_median_vs_fp16"] > 0


def test_random_model_loads(tmp_path):
    """scripts/gpu/random_model.py writes a directory mlx-lm loads and runs."""
    from mlx_lm import generate, load

    spec = importlib.util.spec_from_file_location(
        "random_model", ROOT / "scripts/gpu/random_model.py"
    )
    random_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(random_model)
    out = tmp_path / "model"
    tokenizer = ROOT / "models/SmolLM2-135M-Instruct"
    random_model.main(
        ["--preset", "tiny-cpu", "--tokenizer", str(tokenizer), "--out", str(out)]
    )
    model, tok = load(str(out))
    assert model.args.vocab_size == len(tok.vocab) == 49152
    assert generate(model, tok, "Hello", max_tokens=3)


def test_arch_check_names_the_paths(tmp_path):
    """scripts/gpu/arch_check.py on the CPU (float32; the kernels are CUDA's):
    each model and scheme against the float32 reference, and which kernels
    ran (none here)."""
    spec = importlib.util.spec_from_file_location(
        "arch_check", ROOT / "scripts/gpu/arch_check.py"
    )
    arch_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arch_check)
    out = tmp_path / "arch.json"
    argv = ["--models", "llama", "gpt_oss", "--schemes", "8", "--prompt", "40"]
    argv += ["--chunk", "16", "--decode", "2", "--dtype", "float32"]
    arch_check.main([*argv, "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["scheme"]) for r in rows] == [
        ("llama", "own"),
        ("llama", "8"),
        ("gpt_oss", "own"),
        ("gpt_oss", "8"),
    ]
    assert all(r["kernels"] == {} for r in rows)
    assert rows[0]["rel_err"] == 0 and 0 < rows[1]["rel_err"] < 0.05
