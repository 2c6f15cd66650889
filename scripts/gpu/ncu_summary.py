"""Nsight Compute's text report as JSON: one row per profiled kernel launch.

Reads what ``ncu`` prints (``--section ...`` and ``--metrics ...``) and keeps
each launch's kernel name (MLX's custom-kernel prefix and the argument list
dropped), grid and block, and every "Metric Name  Unit  Value" line of its
sections, as ``{"name": value}`` (numbers where they parse; units are in
``units``). Several reports become one JSON with a ``variant`` per report:

    python3 scripts/gpu/ncu_summary.py base=ncu-a.txt staged=ncu-b.txt --out summary.json
"""

import argparse
import json
import re

KERNEL = re.compile(r"^  (\S.*) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\)")
METRIC = re.compile(r"^    (\S.*?)\s{2,}(\S+)?\s+([-\d.,]+)$")


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def kernel_name(signature):
    """A launch's kernel without its return type, parameter list and MLX's
    custom-kernel prefix (MLX's own kernels are templates in namespaces)."""
    name = signature.removeprefix("void ")
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            name = name[:i] if name[i] == "(" else name
            break
    return name.removeprefix("custom_kernel_")


def launches(lines):
    """The launches of one report, in order."""
    rows = []
    for line in lines:
        kernel = KERNEL.match(line)
        if kernel:
            name = kernel_name(kernel.group(1))
            dims = [int(x) for x in kernel.groups()[1:]]
            rows.append(
                {"kernel": name, "grid": dims[:3], "block": dims[3:], "metrics": {}}
            )
            rows[-1]["units"] = {}
            continue
        metric = METRIC.match(line)
        if metric and rows:
            name, unit, value = metric.groups()
            if unit is not None and re.fullmatch(r"[-\d.,]+", unit):
                continue  # a table row of some other shape
            rows[-1]["metrics"][name] = number(value)
            if unit:
                rows[-1]["units"][name] = unit
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", help="VARIANT=PATH of an ncu report")
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    rows = []
    for report in opts.reports:
        variant, _, path = report.partition("=")
        if not path:
            parser.error(f"{report!r}: give VARIANT=PATH")
        with open(path) as f:
            for row in launches(f.read().splitlines()):
                rows.append({"variant": variant, **row})
    with open(opts.out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    for row in rows:
        m = row["metrics"]
        print(
            f"{row['variant']:10s} {row['kernel'][:48]:48s} "
            f"{m.get('Duration', float('nan')):8.2f} us  "
            f"{m.get('smsp__inst_executed.sum', float('nan')):12,.0f} inst"
        )


if __name__ == "__main__":
    main()
