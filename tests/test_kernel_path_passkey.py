"""scripts/quality/kernel_path_passkey.py on the real SmolLM2 (float32, CPU,
where every path is MLX ops): the same trials along two paths, paired with fp16
and with each other, and each layer's bits as the caches stored them."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts/quality/kernel_path_passkey.py"
SCHEME = "codebook-4+center+qscale+exact8+k5@0.1"


def test_paths_pair_trials_and_record_layer_bits(smollm2_dirs, tmp_path):
    out = tmp_path / "paths.json"
    run = [sys.executable, str(SCRIPT), "--model", str(smollm2_dirs[1])]
    run += ["--context", "384", "--depths", "2", "--keys", "1", "--chunk", "128"]
    run += ["--kv", SCHEME, "--paths", "ops", "decode-ops", "--out", str(out)]
    printed = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    assert f"| {SCHEME} | decode-ops |" in printed
    report = json.loads(out.read_text())
    assert len(report["fp16"]) == 2
    ops, decode_ops = report["results"]
    assert (ops["path"], decode_ops["path"]) == ("ops", "decode-ops")
    # off CUDA no kernel runs: both paths are the same arithmetic
    for a, b in zip(ops["runs"], decode_ops["runs"]):
        assert a["answer_logprob"] == b["answer_logprob"]
    assert decode_ops["vs_ops"]["lost"] == decode_ops["vs_ops"]["gained"] == 0
    key_bits = [bits[0] for bits in ops["layer_bits"]]
    assert len(key_bits) == 30
    assert key_bits[0] == key_bits[1] > key_bits[2] == key_bits[29]
    assert ops["layer_bits"] == decode_ops["layer_bits"]
