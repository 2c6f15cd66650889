#!/usr/bin/env python3
"""Generation with the model sharded over ranks against one process, on this machine.

    .venv/bin/python scripts/distributed/tensor_parallel_check.py [--ranks 2] [--work DIR] [--case C ...]

Writes a random-weight llama whose heads split over the ranks (8 query / 4 KV
heads, float32, SmolLM2's tokenizer), generates every case in this process,
then on RANKS processes launched by ``mlx.launch`` with MLX's ring backend on
127.0.0.1 (the model sharded with ``model.shard``), and prints per case: greedy
tokens equal, the largest log-probability difference and its bound, each
rank's KV heads and cache bytes, and the bytes the cache layout gives. Then
the layout's KV bytes per rank for Llama-3-8B, checked against real caches
built at full size (unevaluated). Exit status 1 if anything differs.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from omlx_cache import tensor_parallel as tp


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--work", help="folder for the model and results (default: temporary)"
    )
    parser.add_argument("--case", action="append", help="cases (default: all)")
    parser.add_argument("--max-tokens", type=int, default=tp.MAX_TOKENS)
    parser.add_argument("--json", help="write the comparison rows to this file")
    args = parser.parse_args(argv)
    cases = args.case or list(tp.DEFAULT_CASES)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        model_dir = work / "model"
        if not (model_dir / "config.json").exists():
            tp.write_model(model_dir)
        start = time.perf_counter()
        tp.run(model_dir, cases, work / "one", args.max_tokens)
        one_s = time.perf_counter() - start
        start = time.perf_counter()
        sharded = tp.launch(
            model_dir, work / "sharded", cases, args.ranks, args.max_tokens
        )
        sharded_s = time.perf_counter() - start
        (one,) = tp.read_reports(work / "one", 1)
        rows = tp.compare(one, sharded)
    print(
        f"one process: {one_s:.1f} s; {args.ranks} ranks (mlx.launch, ring): {sharded_s:.1f} s"
    )
    print("\n".join(tp.comparison_table(rows)))
    print()
    layout = tp.layout_rows(["fp16", "8,4", "4"], [32768, 131072], [1, 2, 4, 8])
    print("KV GiB per rank, Llama-3-8B shape (32 layers, 8 KV heads of 128, float16):")
    print("\n".join(tp.layout_table(layout)))
    layout_ok = all(r["bytes"] == r["built"] for r in layout)
    print(f"layout equals the built caches' nbytes: {layout_ok}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": rows, "layout": layout}, indent=1)
        )
    return 0 if layout_ok and all(map(tp.passed, rows)) else 1


if __name__ == "__main__":
    sys.exit(main())
