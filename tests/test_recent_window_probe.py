"""scripts/quality/recent_window_probe.py on the real SmolLM2 (float32, CPU):
a probe whose window holds every token attends as fp16 KV does, and a
quantized probe, corrected or not, does not."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts/quality/recent_window_probe.py"


def test_probe_pairs_the_first_answer_token(smollm2_dirs, tmp_path):
    out = tmp_path / "probe.json"
    run = [sys.executable, str(SCRIPT), "--model", str(smollm2_dirs[1])]
    run += ["--context", "384", "--depths", "2", "--chunk", "128"]
    run += ["--probe", "100000:3:3", "--probe", "0:3:3", "--probe", "0:3:3d"]
    printed = subprocess.run(
        run + ["--out", str(out)], capture_output=True, text=True, check=True
    ).stdout
    assert "| probe | greedy | lost / gained |" in printed
    report = json.loads(out.read_text())
    assert len(report["reference"]) == 2
    exact, quantized, corrected = (
        report["trials"][name] for name in ("100000:3:3", "0:3:3", "0:3:3d")
    )
    for ref, same in zip(report["reference"], exact):
        assert abs(same["logprob"] - ref["logprob"]) < 1e-3
    assert any(
        abs(a["logprob"] - b["logprob"]) > 1e-3 for a, b in zip(quantized, exact)
    )
    assert any(
        abs(a["logprob"] - b["logprob"]) > 1e-4 for a, b in zip(corrected, quantized)
    )
    assert report["summaries"]["100000:3:3"]["lost"] == 0
