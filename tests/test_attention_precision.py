"""scripts/quality/attention_precision.py on the CPU: in half precision our quantized
attention is at least as close to float32 attention over the cache's content
as mx.fast.scaled_dot_product_attention over the dequantized keys and values
(within 2x), in decode and prefill."""

import importlib.util
import json
import sys
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def precision():
    spec = importlib.util.spec_from_file_location(
        "attention_precision", ROOT / "scripts/quality/attention_precision.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("n_queries", [1, 32])
def test_within_twice_sdpa(precision, dtype, n_queries):
    row = precision.measure(
        dtype, n_queries, n_q_heads=8, n_kv_heads=2, head_dim=64, n_keys=256, repeats=1
    )
    assert row["mode"] == ("decode" if n_queries == 1 else "prefill")
    assert 0 < row["ours_vs_exact"] <= 2 * row["sdpa_vs_exact"]
    # the quantization error dwarfs both
    assert row["quantization_vs_exact"] > 2 * row["ours_vs_exact"]


def test_script(precision, tmp_path, monkeypatch):
    out = tmp_path / "precision.json"
    argv = ["attention_precision.py", "--keys", "128", "--prefill-queries", "16"]
    argv += ["--dtypes", "bfloat16", "--repeats", "1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    precision.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["mode"]) for r in rows] == [
        ("bfloat16", "decode"),
        ("bfloat16", "prefill"),
    ]
    assert all(r["ours_ms"] > 0 for r in rows)
