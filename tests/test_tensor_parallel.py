"""The quantized caches with the model sharded over 2 ranks (mlx.launch, MLX's
ring backend, two processes on 127.0.0.1) against one process.

The model is a random-weight llama with 8 query / 4 KV heads (SmolLM2's 9 / 3
do not split over 2 ranks) saved with SmolLM2's tokenizer; float32 on the CPU.
"""

import pytest

from omlx_cache import tensor_parallel as tp

RANKS = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory, smollm2_dirs):
    work = tmp_path_factory.mktemp("tensor_parallel")
    model_dir = tp.write_model(work / "model", smollm2_dirs[1])
    tp.run(model_dir, tp.DEFAULT_CASES, work / "one")
    (one,) = tp.read_reports(work / "one", 1)
    sharded = tp.launch(model_dir, work / "sharded", tp.DEFAULT_CASES, RANKS)
    return {row["case"]: row for row in tp.compare(one, sharded)}


def test_every_case_ran(results):
    assert list(results) == list(tp.DEFAULT_CASES)


@pytest.mark.parametrize("case", tp.DEFAULT_CASES)
def test_sharded_generation_matches_one_process(results, case):
    row = results[case]
    assert row["tokens_equal"], row
    # fp16 KV: float32 rounding; quantized: a quarter of the scheme's own
    # error against fp16 KV (see tp.QUANTIZED_FRACTION)
    assert row["logprob_diff"] <= row["bound"], row
    if row["quantization_error"] is not None:
        assert row["quantization_error"] > 0.1, row


@pytest.mark.parametrize("case", tp.DEFAULT_CASES)
def test_each_rank_stores_its_heads_only(results, case):
    row = results[case]
    kv_heads = tp.TP_LLAMA_CONFIG["num_key_value_heads"]
    assert row["kv_heads"] == [[kv_heads]] + [[kv_heads // RANKS]] * RANKS
    one, *ranks = row["nbytes"]
    assert ranks == [one // RANKS] * RANKS and one % RANKS == 0


@pytest.mark.parametrize(
    "case", [c for c in tp.DEFAULT_CASES if "@w" not in c and "batch" not in c]
)
def test_layout_gives_each_ranks_bytes(results, case):
    row = results[case]
    one, *ranks = row["nbytes"]
    assert row["layout_nbytes"] == [one, ranks[0]]


def test_layout_equals_built_caches_at_8b():
    schemes = ["fp16", "8,4", "4", "bits=4 group=32 offset=int"]
    rows = tp.layout_rows(schemes, [32768, 131072], [1, 2, 4, 8])
    assert all(r["bytes"] == r["built"] for r in rows)
    by_key = {(r["scheme"], r["context"], r["ranks"]): r["bytes"] for r in rows}
    # fp16 at 128K: 32 layers x 8 heads x 128 x 2 (K, V) x 2 bytes x 131072
    assert by_key["fp16", 131072, 1] == 16 << 30
    assert by_key["4", 131072, 2] * 2 == by_key["4", 131072, 1]


def test_measure_script_on_one_and_two_ranks(tmp_path):
    """scripts/gpu/tp_measure.py: one process, then 2 ranks (ring on the
    CPU), each rank's cache bytes equal to the layout's, with first-token
    and decode times."""
    import json
    import subprocess
    import sys

    from omlx_cache.models import REPO_ROOT

    out = tmp_path / "tp"
    script = REPO_ROOT / "scripts" / "gpu" / "tp_measure.py"
    command = [sys.executable, str(script), "--preset", "tp-llama"]
    command += ["--kv", "fp16", "--kv", "4", "--contexts", "256"]
    command += ["--decode-steps", "2", "--out", str(out)]
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    reports = json.loads((out / "tp-measure.json").read_text())["reports"]
    assert [(r["ranks"], r["rank"]) for r in reports] == [(1, 0), (2, 0), (2, 1)]
    for report in reports:
        heads = tp.TP_LLAMA_CONFIG["num_key_value_heads"] // report["ranks"]
        for row in report["rows"]:
            assert row["kv_heads"] == heads and row["nbytes"] == row["layout"], row
            assert row["first_token_s"] > 0 and row["decode_tok_s"] > 0, row
