"""Tests for omlx_cache.bench at a tiny shape (CPU, float32)."""

import json

import pytest

from omlx_cache import bench
from omlx_cache.kv import attention
from omlx_cache.kv.store import KVStore

TINY = {
    "config": {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 256,
        "tie_word_embeddings": False,
    },
    "dtype": "float32",
    "weights": (64, 4),
    "contexts": (512, 1024),
}

SCHEMES = ["fp16", "upstream-4", "upstream-4@640", "4", "8,4"]
MIB = 1 << 20


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    patch = pytest.MonkeyPatch()
    patch.setitem(bench.PRESETS, "test-tiny", TINY)
    # small score tiles, so our workspace reaches its cap at a tiny context
    args = ["--preset", "test-tiny", "--schemes", *SCHEMES, "--tile-scores", "4096"]
    args += ["--prefill-step", "128", "--page-size", "256"]
    args += ["--decode-tokens", "3", "--decode-warmup", "1"]
    args += ["--sweep-context", "512", "--sweep-schemes", "bits=4 first=0"]
    args += ["--out", str(out / "bench.json"), "--plot-dir", str(out)]
    try:
        bench.main(args)
    finally:
        patch.undo()
    return json.loads((out / "bench.json").read_text()), out


def row(report, context, scheme):
    found = bench.find(report["rows"], context, scheme)
    assert found is not None, (context, scheme)
    return found


def test_rows(run):
    report, _ = run
    expected = {(c, s) for c in TINY["contexts"] for s in SCHEMES}
    expected.add((512, "bits=4 first=0"))
    assert {(r["context"], r["scheme"]) for r in report["rows"]} == expected
    for r in report["rows"]:
        assert "error" not in r and "skipped" not in r, r
        assert r["peak_bytes"] > r["kv_bytes"] > 0
        assert r["decode_tok_s"] > 0 and r["decode_steps"] == 3
        assert r["decode_pipelined_tok_s"] > 0 and r["decode_pipelined_steps"] == 3
        assert r["prefill_logits_rel_err"] < 0.5, r
    assert report["weights_bytes"] > 0
    assert report["running"] is None
    assert report["preset"]["name"] == "test-tiny"
    assert row(report, 1024, "4")["page_size"] == 256
    # the page size and tile are restored after the run
    assert KVStore.page_size == 4096
    assert attention.TILE_SCORES is None
    assert report["tile_scores"] == 4096


def test_upstream_converts_at_its_start(run):
    report, _ = run
    for context, converted in ((512, False), (1024, True)):
        fp = row(report, context, "fp16")["kv_bytes"]
        late = row(report, context, "upstream-4@640")["kv_bytes"]
        assert (late < fp) == converted


def test_our_peak_below_upstream(run):
    report, _ = run
    ours = row(report, 1024, "4")
    upstream = row(report, 1024, "upstream-4")
    assert ours["peak_bytes"] < upstream["peak_bytes"]
    assert ours["workspace_bytes"] < upstream["workspace_bytes"]


def test_our_workspace_does_not_grow(run):
    report, _ = run
    small = row(report, 512, "4")["workspace_bytes"]
    large = row(report, 1024, "4")["workspace_bytes"]
    # one-sided: with the CPU shared, a shorter run has held 0.26 MiB more
    assert large - small < 0.25 * MIB


def test_upstream_workspace_grows(run):
    report, _ = run
    small = row(report, 512, "upstream-4")["workspace_bytes"]
    large = row(report, 1024, "upstream-4")["workspace_bytes"]
    assert large > small + MIB


def test_table_and_plots(run):
    report, out = run
    text = bench.report_markdown(report)
    assert "| context | scheme |" in text and "Sweep at 512 tokens" in text
    for scheme in SCHEMES:
        assert f"| 1024 | {scheme} |" in text
    pytest.importorskip("matplotlib")
    assert (out / "bench-peak.png").stat().st_size > 0
    assert (out / "bench-decode.png").stat().st_size > 0


def test_parse_scheme():
    scheme = bench.parse_scheme("8,4")
    assert (scheme.kind, scheme.bits) == ("ours", (8, 4))
    assert scheme.counterpart == "upstream-4"
    late = bench.parse_scheme("upstream-4@5000")
    assert (late.kind, late.bits, late.quantized_start) == ("upstream", (4, 4), 5000)
    assert bench.parse_scheme("fp16").kind == "fp"
    assert bench.parse_scheme("codec=codebook bits=3").counterpart is None
    for bad in ("7", "8,4+reserve", "cq4"):
        with pytest.raises(ValueError):
            bench.parse_scheme(bad)


def test_merge(run, tmp_path):
    report, _ = run
    first = dict(report, rows=report["rows"][:3])
    second = dict(report, rows=report["rows"][2:])
    for name, part in (("a.json", first), ("b.json", second)):
        (tmp_path / name).write_text(json.dumps(part))
    merged = bench.merge([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert len(merged["rows"]) == len(report["rows"])
    assert [m["file"] for m in merged["merged_from"]] == ["a.json", "b.json"]


def tiny_run(tmp_path, *extra):
    patch = pytest.MonkeyPatch()
    patch.setitem(bench.PRESETS, "test-tiny", TINY)
    args = ["--preset", "test-tiny", "--contexts", "512", "--prefill-step", "128"]
    args += ["--decode-tokens", "2", "--decode-warmup", "1", *extra]
    try:
        return bench.bench(bench.parse_args(args))
    finally:
        patch.undo()


def test_synthetic_fill(tmp_path):
    report = tiny_run(
        tmp_path, "--fill", "synthetic", "--schemes", "fp16", "4", "upstream-4@256"
    )
    for r in report["rows"]:
        assert r["fill"] == "synthetic" and "error" not in r, r
        assert "prefill_logits_rel_err" not in r
        assert r["decode_logits_rel_err"] < 0.5
    assert bench.find(report["rows"], 512, "fp16") is None
    fp = bench.find(report["rows"], 512, "fp16", "synthetic")
    late = bench.find(report["rows"], 512, "upstream-4@256", "synthetic")
    assert late["kv_bytes"] < fp["kv_bytes"]
    assert "synthetic fill" in bench.report_markdown(report)


def test_decode_error_keeps_prefill(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no implementation")

    monkeypatch.setattr(bench.timing, "decode", broken)
    report = tiny_run(tmp_path, "--schemes", "fp16", "4")
    for r in report["rows"]:
        assert r["decode_error"] == "RuntimeError: no implementation"
        assert r["peak_bytes"] > 0 and "decode_tok_s" not in r
    assert "| error |" in bench.report_markdown(report)


def test_other_schemes(tmp_path):
    with pytest.raises(ValueError, match="Unknown scheme item"):
        bench.parse_scheme("codebook=3")
    names = ("codec=codebook bits=3", "bits=4 center=k")
    report = tiny_run(tmp_path, "--schemes", "fp16", *names)
    for r in report["rows"]:
        assert "error" not in r and r["decode_tok_s"] > 0, r
    for name in names:
        r = bench.find(report["rows"], 512, name)
        assert r["prefill_logits_rel_err"] < 0.5 and r["kv_bytes"] > 0


def test_decode_modes(tmp_path):
    # generate_step's overlapped loop alone: its steps, no synchronous ones,
    # and tables that show what was measured
    report = tiny_run(
        tmp_path, "--schemes", "fp16", "8,4", "--decode-mode", "pipelined"
    )
    for r in report["rows"]:
        assert r["decode_pipelined_steps"] == 2 and r["decode_pipelined_tok_s"] > 0
        # tokens/s over the steps' total time, next to the median step's
        mean = sum(r["decode_pipelined_ms"]) / len(r["decode_pipelined_ms"])
        assert r["decode_pipelined_ms_mean"] == pytest.approx(mean, rel=1e-3)
        assert r["decode_pipelined_tok_s_mean"] == pytest.approx(1e3 / mean, rel=1e-3)
        assert "decode_tok_s" not in r and "error" not in r, r
    text = bench.report_markdown(report)
    assert "pipelined decode tok/s" in text and "| error |" not in text
    assert "pipelined tok/s, all steps" in text


@pytest.mark.parametrize("fill", ["prefill", "synthetic"])
def test_batch(tmp_path, fill):
    # two left-padded sequences in mlx-lm's batch caches; a scheme without a
    # batch cache is refused by name
    args = ["--schemes", "fp16", "8,4", "upstream-4", "--batch", "2", "--fill", fill]
    args += ["--page-size", "256"]
    report = tiny_run(tmp_path, *args)
    fp, ours, named = (bench.find(report["rows"], 512, s, fill) for s in bench_names())
    for r in (fp, ours):
        assert r["batch"] == 2 and "error" not in r, r
        assert r["decode_tok_s"] > 0 and r["decode_pipelined_tok_s"] > 0
    assert ours["kv_bytes"] < fp["kv_bytes"]
    if fill == "prefill":
        assert ours["prefill_logits_rel_err"] < 0.5
    assert "upstream-4" in named["error"] and "--batch" in named["error"]
    assert "2 sequences per step" in bench.report_markdown(report)


def bench_names():
    return ("fp16", "8,4", "upstream-4")
