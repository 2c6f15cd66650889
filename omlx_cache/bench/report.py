"""The bench's report: markdown tables (ratios to fp16 and to upstream, the
bandwidth floor), plots, and merging the JSON of several runs."""

import json
from pathlib import Path

from .caches import left_padding, parse_scheme
from .common import GIB, MIB, log


def ok(row: dict | None, key: str = "peak_bytes") -> bool:
    """Whether ``row`` measured ``key`` (its decode may have failed alone)."""
    return row is not None and key in row


def row_fill(row: dict) -> tuple[str, int | None]:
    """How the row's cache was filled: the fill and its step in tokens."""
    return row.get("fill", "prefill"), row.get("prefill_step")


def row_key(row: dict) -> tuple:
    return row["context"], row["scheme"], *row_fill(row)


def find(rows, context, scheme, fill="prefill", step=None):
    """The row of (context, scheme) filled so (any step when ``step`` is None)."""
    for row in rows:
        row_fill_, row_step = row_fill(row)
        if (row["context"], row["scheme"], row_fill_) != (context, scheme, fill):
            continue
        if step is None or row_step == step:
            return row
    return None


def ratio(row, other, key) -> str:
    if not (ok(row, key) and ok(other, key)) or not other[key]:
        return "—"
    return f"{row[key] / other[key]:.2f}"


def memory_unit(rows) -> tuple[str, int]:
    peaks = [r["peak_bytes"] for r in rows if ok(r)]
    return ("GiB", GIB) if peaks and max(peaks) >= GIB else ("MiB", MIB)


def markdown_table(rows: list[dict], weights_bytes: int, everything=None) -> list[str]:
    """One line per (context, scheme); ratios against fp16 and against the
    upstream counterpart at the same context (found in ``everything``)."""
    everything = everything or rows
    unit, scale = memory_unit(rows)
    lines = [
        (
            f"| context | scheme | weights {unit} | KV {unit} (nbytes) | peak {unit} "
            f"| workspace {unit} | prefill tok/s | decode tok/s | peak / fp16 "
            "| peak / upstream | decode / fp16 | decode / upstream "
            "| pipelined decode tok/s | pipelined / fp16 "
            "| pipelined tok/s, all steps | all steps / fp16 "
            "| logits err (prefill, decode) |"
        ),
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        head = f"| {row['context']} | {row['scheme']} | {weights_bytes / scale:.3f} |"
        if not ok(row):
            note = (row.get("error") or row.get("skipped", "")).replace("|", "/")
            lines.append(f"{head} {note[:120]} |" + " |" * 13)
            continue
        fill, step = row_fill(row)
        counterpart = parse_scheme(row["scheme"]).counterpart
        fp = find(everything, row["context"], "fp16", fill, step)
        up = find(everything, row["context"], counterpart, fill, step)
        missing = "error" if "decode_error" in row else "—"
        decode, pipelined, pipelined_mean = (
            f"{row[key]:.1f}" if ok(row, key) else missing
            for key in (
                "decode_tok_s",
                "decode_pipelined_tok_s",
                "decode_pipelined_tok_s_mean",
            )
        )
        errors = [row.get(f"{k}_logits_rel_err") for k in ("prefill", "decode")]
        errors = ", ".join("—" if e is None else f"{e:.3g}" for e in errors)
        lines.append(
            f"{head} {row['kv_bytes'] / scale:.3f} | {row['peak_bytes'] / scale:.3f} "
            f"| {row['workspace_bytes'] / scale:.3f} | {row['prefill_tok_s']:.0f} "
            f"| {decode} | {ratio(row, fp, 'peak_bytes')} "
            f"| {ratio(row, up, 'peak_bytes')} | {ratio(row, fp, 'decode_tok_s')} "
            f"| {ratio(row, up, 'decode_tok_s')} | {pipelined} "
            f"| {ratio(row, fp, 'decode_pipelined_tok_s')} | {pipelined_mean} "
            f"| {ratio(row, fp, 'decode_pipelined_tok_s_mean')} | {errors} |"
        )
    return lines


def floor_table(rows: list[dict]) -> list[str]:
    """Decode time against the bytes every step reads over the bandwidth."""
    rows = [r for r in rows if ok(r) and "floor_ms" in r]
    rows = [
        r for r in rows if "decode_ms_median" in r or "decode_pipelined_ms_median" in r
    ]
    if not rows:
        return []
    lines = [
        (
            "| context | scheme | fill, step | decode ms | pipelined decode ms "
            "| KV floor ms | weights + KV floor ms | decode / floor |"
        ),
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fill = "{}, {}".format(*row_fill(r))
        sync, pipelined = (
            r.get(f"{key}_ms_median") for key in ("decode", "decode_pipelined")
        )
        best = min(t for t in (sync, pipelined) if t is not None)
        sync, pipelined = ("—" if t is None else f"{t:.2f}" for t in (sync, pipelined))
        lines.append(
            f"| {r['context']} | {r['scheme']} | {fill} | {sync} | {pipelined} "
            f"| {r['kv_floor_ms']:.3f} | {r['floor_ms']:.3f} "
            f"| {best / r['floor_ms']:.2f} |"
        )
    return lines


FILLS = {
    "prefill": "chunked prefill",
    "synthetic": "synthetic fill (random keys and values written to the cache, "
    "no prefill attention: decode speed only)",
}


def report_markdown(report: dict) -> str:
    device = report["device"].get("device_name", report["device"]["default_device"])
    preset = report["preset"]
    lines = [
        f"bench {preset['name']} ({preset['dtype']}) on {device}, "
        + f"{report['date']}, mlx {report['versions']['mlx']}"
    ]
    batch = report["args"].get("batch", 1)
    if batch > 1:
        padding = left_padding(batch)
        note = (
            f"{batch} sequences per step, left-padded by {padding} tokens (mlx-lm's "
            "batch caches); prefill and decode tokens/s summed over them (padding "
            "included), decode ms per step"
        )
        lines += ["", note]
    for fill, step in sorted({row_fill(r) for r in report["rows"]}, key=str):
        rows = [r for r in report["rows"] if row_fill(r) == (fill, step)]
        lines += ["", f"Cache filled by {FILLS[fill]}, {step}-token steps", ""]
        lines += fill_tables(rows, report["weights_bytes"])
    floors = floor_table(report["rows"])
    if floors:
        lines += ["", f"Bandwidth floor ({report['args']['bandwidth_gbs']:g} GB/s)", ""]
        lines += floors
    return "\n".join(lines)


def fill_tables(rows: list[dict], weights_bytes: int) -> list[str]:
    """The grid, then the sweep (more schemes at one context) with the grid's rows
    at its context."""
    grid = [r for r in rows if not r["sweep"]]
    sweep = [r for r in rows if r["sweep"]]
    lines = markdown_table(grid, weights_bytes) if grid else []
    if sweep:
        context = sweep[0]["context"]
        same = [
            r
            for r in grid
            if r["context"] == context and parse_scheme(r["scheme"]).kind == "ours"
        ]
        lines += ["", f"Sweep at {context} tokens", ""]
        lines += markdown_table(same + sweep, weights_bytes, rows)
    return lines


def plot(report: dict, plot_dir, prefix: str) -> list[str]:
    """Peak memory and decode speed against context, one line per scheme:
    ``{prefix}-peak.png``, ``{prefix}-decode.png`` and, for a synthetic fill,
    ``{prefix}-decode-synthetic.png``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("bench: matplotlib is missing: no plots")
        return []
    device = report["device"].get("device_name", report["device"]["default_device"])
    title = f"{report['preset']['name']} ({report['preset']['dtype']}), {device}"
    rows = [r for r in report["rows"] if ok(r) and not r["sweep"]]
    prefilled = [r for r in rows if r.get("fill", "prefill") == "prefill"]
    synthetic = [r for r in rows if r.get("fill") == "synthetic"]
    plots = (
        (prefilled, "peak_bytes", "peak memory during prefill (GiB)", GIB, "peak"),
        (prefilled, "decode_tok_s", "decode tokens/s", 1, "decode"),
        (
            synthetic,
            "decode_tok_s",
            "decode tokens/s (synthetic fill)",
            1,
            "decode-synthetic",
        ),
    )
    paths = []
    for selected, key, label, scale, name in plots:
        selected = [r for r in selected if key in r]
        if not selected:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        steps = {r.get("prefill_step") for r in selected}
        for line in dict.fromkeys(
            (r["scheme"], r.get("prefill_step")) for r in selected
        ):
            points = [
                (r["context"], r[key] / scale)
                for r in selected
                if (r["scheme"], r.get("prefill_step")) == line
            ]
            label_ = line[0] if len(steps) < 2 else f"{line[0]}, step {line[1]}"
            ax.plot(*zip(*points), marker="o", label=label_)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        path = Path(plot_dir) / f"{prefix}-{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths


def merge(paths: list[str]) -> dict:
    """Join the rows of several runs (later files win) under the first's
    metadata."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    merged = dict(reports[0])
    rows = {}
    for report in reports:
        for row in report["rows"]:
            # a case its run's deadline skipped measured nothing
            if "deadline" in row.get("skipped", ""):
                continue
            row.setdefault("fill", report["args"].get("fill", "prefill"))
            row.setdefault("prefill_step", report["args"]["prefill_step"])
            rows[row_key(row)] = row
        for key in ("probe", "warmup_errors"):
            if key in report and key not in merged:
                merged[key] = report[key]
    merged["rows"] = sorted(
        rows.values(), key=lambda r: (r.get("fill", ""), r["sweep"], r["context"])
    )
    merged["merged_from"] = [
        {"file": Path(p).name, "date": r["date"], "args": r["args"]}
        for p, r in zip(paths, reports)
    ]
    return merged


def summary(row: dict) -> str:
    if "error" in row or "skipped" in row:
        return row.get("error") or row["skipped"]
    decode = row.get("decode_error") or ", ".join(
        f"{row[key + '_tok_s']:.1f} tok/s{label}"
        for key, label in (("decode", ""), ("decode_pipelined", " pipelined"))
        if key + "_tok_s" in row
    )
    return (
        f"peak {row['peak_bytes'] / MIB:.1f} MiB, KV {row['kv_bytes'] / MIB:.1f} MiB, "
        f"workspace {row['workspace_bytes'] / MIB:.1f} MiB, "
        f"prefill {row['prefill_tok_s']:.0f} tok/s, decode {decode}"
    )
