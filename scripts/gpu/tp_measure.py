#!/usr/bin/env python3
"""Each rank's KV bytes, peak memory, first-token time and decode speed with the
model sharded over ranks, against one process, in one run.

    python3 scripts/gpu/tp_measure.py --ranks 1,2 --kv fp16 --kv 8,4 --kv 4 \\
        --contexts 32768,131072 --out $OUT/tp

For each rank count: 1 runs ``python -m omlx_cache.tensor_parallel measure`` in
a child process on the first device; more ranks run it under ``mlx.launch``
(NCCL, one GPU per rank, where MLX has CUDA; else the ring backend on the
CPU). Random-weight llama at the preset's shape (default Llama-3-8B, 4-bit
weights); each rank writes ``OUT/ranks{N}/measure-rank{R}.json`` after every
row, so a run cut short keeps what it measured. Prints one table and writes
``OUT/tp-measure.json``; ``--report`` only reads what is there. Exit status 1
if a rank's cache bytes differ from the layout's (contexts in multiples of
256: fp16's ``KVCache`` grows in steps of 256).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

from omlx_cache import tensor_parallel as tp


def measure_args(args, out: Path) -> list[str]:
    command = ["measure", "--preset", args.preset, "--contexts", args.contexts]
    for name in args.kv:
        command += ["--kv", name]
    command += ["--decode-steps", str(args.decode_steps), "--out", str(out)]
    return command


def run_ranks(args, n: int, backend: str):
    out = Path(args.out) / f"ranks{n}"
    if n == 1:
        command = [sys.executable, "-m", "omlx_cache.tensor_parallel"]
        command += measure_args(args, out)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    else:
        command = tp.launch_command(
            n,
            tp.free_ports(n),  # the ring backend takes a port per rank
            [*measure_args(args, out), "--backend", backend],
            backend,
        )
        env = None
    tp.log(f"{n} rank{'s' * (n > 1)}: {' '.join(command)}")
    done = subprocess.run(command, env=env, timeout=args.timeout, check=False)
    if done.returncode not in (0, 1):
        tp.log(f"{n} ranks exited with {done.returncode}")


def read_all(out: Path) -> list[dict]:
    paths = sorted(out.glob("ranks*/measure-rank*.json"))
    reports = [json.loads(p.read_text()) for p in paths]
    return sorted(reports, key=lambda r: (r["ranks"], r["rank"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,2", help="rank counts, in order")
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--kv", action="append", help="schemes (default fp16, 8,4, 4)")
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--backend", help="default: nccl with CUDA, else ring")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per count")
    parser.add_argument("--report", action="store_true", help="only read OUT")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    args.kv = args.kv or ["fp16", "8,4", "4"]
    backend = args.backend or ("nccl" if mx.cuda.is_available() else "ring")
    if not args.report:
        for n in (int(x) for x in args.ranks.split(",")):
            run_ranks(args, n, backend)
    reports = read_all(Path(args.out))
    print("\n".join(tp.measure_table(reports)))
    Path(args.out, "tp-measure.json").write_text(
        json.dumps({"backend": backend, "reports": reports}, indent=1)
    )
    rows = [r for report in reports for r in report["rows"]]
    return 0 if rows and all(r["nbytes"] == r["layout"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
