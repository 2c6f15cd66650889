"""The bench's run: build the models, run the grid of (context, scheme) cases
within their budgets, keep the JSON up to date, and the command line."""

import argparse
import faulthandler
import gc
import platform
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import mlx.core as mx
import mlx_lm

from ..kv import attention
from ..kv.store import KVStore
from .caches import DEFAULT_SCHEMES, Scheme, page_size, parse_scheme, setting
from .common import GIB, PROCESS_START, int_list, log, write_json
from .models import PRESETS, REPO_ROOT, build_models, import_pristine, pristine_version
from .report import find, merge, plot, report_markdown, summary
from .timing import (
    DECODE_MODES,
    BudgetExceeded,
    Setup,
    case_row,
    probe,
    run_case,
)


class Runner:
    """Runs the cases in order, keeps the JSON on disk up to date after each
    one, and skips what the budgets rule out."""

    def __init__(self, setup: Setup, report: dict):
        self.setup = setup
        self.report = report
        self.over_budget = set()

    def save(self):
        out = self.setup.options.out
        self.report["elapsed_s"] = time.perf_counter() - PROCESS_START
        if out:
            write_json(out, self.report)

    def skip_reason(self, scheme: Scheme) -> str | None:
        opts = self.setup.options
        if opts.deadline and time.perf_counter() - PROCESS_START > opts.deadline:
            return f"skipped: the run's deadline ({opts.deadline:g} s) has passed"
        if scheme.name in self.over_budget:
            return "skipped: over the case budget at a smaller context"
        return None

    def grid(self, schemes: list[Scheme], contexts: list[int]):
        """Every scheme at every context, after an untimed warm-up."""
        warmup = self.setup.options.warmup
        if warmup and schemes:
            errors = warm_up(self.setup, schemes, warmup)
            self.report.setdefault("warmup_errors", {}).update(errors)
        for context in contexts:
            for scheme in schemes:
                self.run(scheme, context)

    def sweep(self, schemes: list[Scheme], context: int):
        """More schemes (page sizes) at one context, with fp16 for reference."""
        self.over_budget.clear()
        fill = self.setup.options.fill
        for scheme in [parse_scheme("fp16")] + schemes if schemes else []:
            if not find(self.report["rows"], context, scheme.name, fill=fill):
                self.run(scheme, context, sweep=scheme.kind != "fp")

    def run(self, scheme: Scheme, context: int, sweep: bool = False):
        row = case_row(scheme, context, sweep, self.setup.options)
        reason = self.skip_reason(scheme)
        if reason:
            row["skipped"] = reason
        else:
            log(f"bench: {scheme.name} at {context} tokens{' (sweep)' * sweep}")
            self.report["running"] = row
            self.save()
            row = self.guarded(scheme, context, sweep)
        self.report["running"] = None
        self.report["rows"].append(row)
        self.save()
        log("bench:   " + summary(row))
        return row

    def guarded(self, scheme, context, sweep):
        timeout = self.setup.options.case_timeout
        if timeout:
            # a hung kernel cannot be interrupted: end the process, whose JSON
            # already names the running case
            faulthandler.dump_traceback_later(timeout, exit=True)
        row = case_row(scheme, context, sweep, self.setup.options)
        try:
            return run_case(self.setup, scheme, context, sweep)
        except BudgetExceeded as e:
            self.over_budget.add(scheme.name)
            budget = self.setup.options.case_budget
            return {**row, "skipped": f"{e} ({budget:g} s budget)"}
        # upstream's quantized attention raises on CUDA; any error is recorded
        except Exception as e:  # noqa: BLE001
            return {**row, "error": f"{type(e).__name__}: {e}"}
        finally:
            if timeout:
                faulthandler.cancel_dump_traceback_later()
            gc.collect()
            mx.clear_cache()


def warm_up(setup: Setup, schemes: list[Scheme], tokens: int):
    """Run every scheme once at a small context, untimed (CUDA compiles its
    kernels at first use)."""
    errors = {}
    opts = setup.options
    references = dict(setup.references)
    saved = opts.decode_warmup, opts.decode_tokens
    opts.decode_warmup, opts.decode_tokens = 0, 2
    try:
        for scheme in schemes:
            tic = time.perf_counter()
            try:
                run_case(setup, scheme, tokens)
            except Exception as e:  # noqa: BLE001 (recorded, as in the run)
                errors[scheme.name] = f"{type(e).__name__}: {e}"
            log(f"bench: warm-up {scheme.name}: {time.perf_counter() - tic:.1f} s")
            gc.collect()
            mx.clear_cache()
    finally:
        opts.decode_warmup, opts.decode_tokens = saved
        setup.references = references
    return errors


def device_bandwidth_gbs(info: dict) -> float | None:
    """Datasheet memory bandwidth of the GPUs we run on, in GB/s."""
    name = str(info.get("device_name", info.get("name", "")))
    for gpu, gbs in (("H100", 3350.0), ("H200", 4800.0)):
        if gpu in name:
            return gbs
    return None


def device_info() -> dict:
    info = {"default_device": str(mx.default_device())}
    try:
        info.update({k: str(v) for k, v in mx.device_info().items()})
    except AttributeError as e:  # older MLX
        info["device_info_error"] = str(e)
    return info


def versions() -> dict:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "mlx": mx.__version__,
        "mlx_lm_patched": mlx_lm.__version__,
        "mlx_lm_patched_path": str(Path(mlx_lm.__file__).parent),
        "mlx_lm_patched_commit": patched_commit(),
        "mlx_lm_pristine": pristine_version(),
        "git": git_head(REPO_ROOT),
    }


def patched_commit() -> str | None:
    """The vendored repo's commit, or that named in a ``COMMIT`` file beside
    the package (a snapshot taken with ``git archive``)."""
    root = Path(mlx_lm.__file__).resolve().parents[1]
    if (root / "COMMIT").exists():
        return (root / "COMMIT").read_text().strip()
    return git_head(root)


def git_head(root: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def bench(options: argparse.Namespace) -> dict:
    """Build the models, run every case and return the report."""
    tiles = setting(attention, "TILE_SCORES", options.tile_scores)
    with page_size(options.page_size), tiles:
        return run_bench(options)


def run_bench(options: argparse.Namespace) -> dict:
    preset = PRESETS[options.preset]
    dtype = getattr(mx, options.dtype or preset["dtype"])
    info = device_info()
    if options.bandwidth_gbs is None:
        options.bandwidth_gbs = device_bandwidth_gbs(info)
    schemes = [parse_scheme(s) for s in options.schemes]
    sweep = [parse_scheme(s) for s in options.sweep_schemes]

    log(f"bench: building {options.preset} ({dtype}) on {info['default_device']}")
    tic = time.perf_counter()
    ours, upstream = build_models(preset, dtype)
    _, upstream_cache = import_pristine()
    gc.collect()
    mx.clear_cache()
    weights = mx.get_active_memory()
    log(f"bench: weights {weights / GIB:.3f} GiB in {time.perf_counter() - tic:.1f} s")
    setup = Setup(ours, upstream, upstream_cache, options, weights)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": info,
        "versions": versions(),
        "args": {k: v for k, v in vars(options).items()},
        "preset": {"name": options.preset, **preset, "dtype": str(dtype)},
        "weights_bytes": weights,
        "default_page_size": KVStore.page_size,
        "tile_scores": tile_scores(),
        "rows": [],
        "running": None,
    }
    if options.probe:
        report["probe"] = probe()
    runner = Runner(setup, report)
    # upstream's quantized attention can fail, or hang, on CUDA: it runs last
    ours = sorted((s for s in schemes if s.kind != "upstream"), key=lambda s: s.kind)
    runner.grid(ours, options.contexts)
    runner.sweep(sweep, options.sweep_context)
    runner.grid([s for s in schemes if s.kind == "upstream"], options.contexts)
    return report


def tile_scores() -> int:
    """Scores per attention tile of our stores."""
    return attention.tile_scores()


# --- command line ----------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m omlx_cache.bench",
        description="Peak memory and decode speed of KV cache schemes, "
        "ours and upstream mlx-lm's, in one process.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny-cpu")
    parser.add_argument(
        "--contexts", type=int_list, help="comma-separated (default: the preset's)"
    )
    parser.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES))
    parser.add_argument("--decode-tokens", type=int, default=16, help="timed steps")
    parser.add_argument("--decode-warmup", type=int, default=3, help="untimed steps")
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="sequences decoded together, with left padding, in mlx-lm's batch "
        "caches (fp16 and our schemes); tokens/s are summed over them",
    )
    parser.add_argument(
        "--decode-mode",
        choices=sorted(DECODE_MODES),
        default="both",
        help="sync: evaluate each step before building the next; pipelined: queue "
        "the next step first, as generate_step does (default: both, in that order)",
    )
    parser.add_argument("--prefill-step", type=int, default=2048)
    parser.add_argument(
        "--fill",
        choices=("prefill", "synthetic"),
        default="prefill",
        help="fill the cache by chunked prefill, or with random keys and values "
        "(decode speed only: no prefill attention, no logits after the fill)",
    )
    parser.add_argument("--dtype", help="activations (default: the preset's)")
    parser.add_argument("--kv-group-size", type=int, default=64)
    parser.add_argument("--page-size", type=int, help="KVStore.page_size")
    parser.add_argument(
        "--tile-scores",
        type=int,
        help="omlx_cache.kv.attention.TILE_SCORES: scores per attention tile "
        "(default: the device's, 2^24, or 2^26 on CUDA)",
    )
    parser.add_argument(
        "--sweep-schemes",
        nargs="*",
        default=[],
        help="schemes run at --sweep-context only",
    )
    parser.add_argument("--sweep-context", type=int, default=32768)
    parser.add_argument(
        "--warmup", type=int, default=0, help="run each scheme untimed at this context"
    )
    parser.add_argument(
        "--case-budget", type=float, default=0, help="seconds per case (0: none)"
    )
    parser.add_argument(
        "--case-timeout",
        type=float,
        default=0,
        help="end the process when one case runs this long (a hung kernel)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=0,
        help="skip the cases that start later than this many seconds into the run",
    )
    parser.add_argument(
        "--bandwidth-gbs", type=float, help="default: H100/H200 datasheet"
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="first try the attention's quantized matmuls at an 8B model's shapes",
    )
    parser.add_argument("--out", help="JSON file (rewritten after every case)")
    parser.add_argument("--plot-dir")
    parser.add_argument("--plot-prefix", default="bench")
    parser.add_argument(
        "--merge", nargs="+", help="join these JSON files instead of running"
    )
    options = parser.parse_args(argv)
    if options.contexts is None:
        options.contexts = list(PRESETS[options.preset]["contexts"])
    return options


def main(argv=None):
    options = parse_args(argv)
    if options.merge:
        report = merge(options.merge)
    else:
        report = bench(options)
    if options.out:
        write_json(options.out, report)
    if options.plot_dir:
        for path in plot(report, options.plot_dir, options.plot_prefix):
            log(f"bench: wrote {path}")
    print(report_markdown(report))
