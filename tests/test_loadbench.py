"""``omlx_cache.loadbench`` against the real server on 127.0.0.1: 16 streaming
clients at once, each request completed without a server error; with fp16
every answer is the one the same prompt gets alone; the JSON and the plot."""

import json

import pytest

from omlx_cache import loadbench


def test_sixteen_clients_at_once(smollm2_dirs, tmp_path, capsys):
    out = tmp_path / "load.json"
    argv = ["--model", str(smollm2_dirs[1]), "--kv", "fp16", "--kv", "8,4"]
    argv += ["--clients", "16", "--requests", "16", "--lengths", "32,96"]
    argv += ["--max-tokens", "8", "--check", "--out", str(out)]
    rows = loadbench.main([*argv, "--plot", str(tmp_path / "load.png")])
    assert [r["completed"] for r in rows] == [16, 16]
    assert [r["failed"] for r in rows] == [0, 0]
    assert rows[0]["same_as_alone"] == 16
    assert all(r["ttft_p95_s"] >= r["ttft_p50_s"] > 0 for r in rows)
    assert json.loads(out.read_text())["rows"][1]["scheme"] == "8,4"
    assert (tmp_path / "load.png").stat().st_size > 0
    assert "| 8,4 | 16/16 | 0 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--kv", "bits=4 centre=k"], "Unknown scheme item"),
        (["--lengths", "0,256"], "token counts of 1 or more"),
        (["--shared", "2"], "a share, 0 to 1"),
        (["--clients", "0"], "1 or more"),
        (["--text", "/no/such/file"], "no such file"),
    ],
)
def test_bad_flags_are_named(flags, error, capsys):
    with pytest.raises(SystemExit):
        loadbench.main(["--model", "m", "--out", "o.json", *flags])
    assert error in capsys.readouterr().err
