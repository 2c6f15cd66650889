"""What every part of the bench shares: the run's clock, its log, units and
the JSON writer."""

import json
import os
import sys
import time
from pathlib import Path

PROCESS_START = time.perf_counter()
GIB = 1 << 30
MIB = 1 << 20


def log(*parts):
    elapsed = time.perf_counter() - PROCESS_START
    print(f"[{elapsed:5.0f} s]", *parts, file=sys.stderr, flush=True)


def write_json(path, report: dict):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, path)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]
