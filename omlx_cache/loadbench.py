"""Many streaming clients at once against the real HTTP server, per KV scheme.

For each scheme a fresh ``mlx_lm.server`` is started on 127.0.0.1 (fp16: the
model's own caches; others through ``--kv-cache omlx --kv-cache-config``),
then ``--clients`` threads send ``--requests`` streaming chat completions
through the ``openai`` client: prompts cut from ``--text`` to token lengths
drawn from ``--lengths``, a share of them (``--shared``) after one long
system prompt, greedy. Reported per scheme: time to first token (p50, p95),
completion tokens per second over the run, requests completed and failed,
the server's peak resident memory (and GPU memory, where ``nvidia-smi``
reports it), and with ``--check`` how many answers
equal the same prompt's asked alone afterwards.

    python -m omlx_cache loadbench --model models/SmolLM2-135M-Instruct-f32 \\
        --kv fp16 --kv 8,4 --kv 4 --clients 16 --requests 32 \\
        --lengths 256,1024 --out build/loadbench.json --plot build/loadbench.png
"""

import argparse
import concurrent.futures
import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .disk_bench import Server, scheme, server_args

DEFAULT_TEXT = (
    Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"
)


def peak_rss_bytes(pid: int):
    """A process's peak resident memory (Linux), or None."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


class GpuPeak:
    """The most GPU memory ``nvidia-smi`` reports for a process, sampled
    twice a second while the run lasts (``peak`` None without nvidia-smi)."""

    def __init__(self, pid: int):
        self.pid, self.peak = pid, None
        self._stop = threading.Event()
        self._thread = None
        if shutil.which("nvidia-smi"):
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self):
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory"]
        query += ["--format=csv,noheader,nounits"]
        while not self._stop.wait(0.5):
            run = subprocess.run(query, check=False, capture_output=True, text=True)
            out = run.stdout
            for line in out.splitlines():
                pid, mib = (x.strip() for x in line.split(","))
                if pid == str(self.pid) and mib.isdigit():
                    self.peak = max(self.peak or 0, int(mib) * 2**20)

    def stop(self):
        self._stop.set()
        if self._thread:
            self._thread.join()
        return self.peak


def make_requests(tokenizer, text, n, lengths, shared, seed=0):
    """``n`` (system prompt or None, user prompt) pairs: the user prompts cut
    from ``text`` to token lengths drawn from ``lengths`` (a question added),
    a ``shared`` share after one system prompt of ``lengths[0]`` tokens."""
    rng = random.Random(seed)
    tokens = tokenizer.encode(text)
    system = tokenizer.decode(tokens[: lengths[0]])
    out = []
    for i in range(n):
        length = rng.choice(lengths)
        start = rng.randrange(lengths[0], max(len(tokens) - length, lengths[0] + 1))
        passage = tokenizer.decode(tokens[start : start + length])
        prompt = f"{passage}\n\nIn one sentence, what is this passage about?"
        out.append((system if rng.random() < shared else None, prompt))
    return out


def _messages(system, prompt):
    messages = [{"role": "user", "content": prompt}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return messages


def ask(client, system, prompt, max_tokens):
    """(answer, seconds to its first piece, pieces, seconds in all), streamed."""
    start = time.perf_counter()
    first, pieces = None, []
    stream = client.chat.completions.create(
        model="default_model",
        messages=_messages(system, prompt),
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - start
            pieces.append(chunk.choices[0].delta.content)
    return "".join(pieces), first, len(pieces), time.perf_counter() - start


def _percentile(values, q):
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_scheme(model, name, requests, opts, log_dir):
    import openai

    # an empty hub: /v1/models lists the model served only
    hub = tempfile.mkdtemp(prefix="omlx-loadbench-hub-")
    env = {"HF_HUB_CACHE": hub}
    server = Server(model, log_dir, *server_args(name), env=env, timeout=600)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    gpu = GpuPeak(server.proc.pid)
    results, failed, failed_alone = [None] * len(requests), [], []
    done = 0
    began = time.perf_counter()

    def one(i):
        return i, ask(client, *requests[i], opts.max_tokens)

    try:
        with concurrent.futures.ThreadPoolExecutor(opts.clients) as pool:
            futures = [pool.submit(one, i) for i in range(len(requests))]
            for future in concurrent.futures.as_completed(futures):
                try:
                    i, result = future.result()
                    results[i] = result
                except Exception as e:  # noqa: BLE001 (a server error is a result)
                    failed.append(f"{type(e).__name__}: {e}"[:200])
                done += 1
                print(
                    f"\r{name}: {done}/{len(requests)} requests",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
        wall = time.perf_counter() - began
        print(file=sys.stderr)
        same = None
        if opts.check:
            alone = []
            for r in requests:
                try:
                    alone.append(ask(client, *r, opts.max_tokens)[0])
                except Exception as e:  # noqa: BLE001
                    failed_alone.append(f"{type(e).__name__}: {e}"[:200])
                    alone.append(None)
            same = sum(
                r is not None and r[0] == a for r, a in zip(results, alone, strict=True)
            )
        peak = peak_rss_bytes(server.proc.pid)
    finally:
        gpu_peak = gpu.stop()
        server.stop()
    ok = [r for r in results if r is not None]
    firsts = [r[1] for r in ok if r[1] is not None]
    pieces = sum(r[2] for r in ok)
    return {
        "scheme": name,
        "requests": len(requests),
        "completed": len(ok),
        "failed": len(failed),
        "errors": failed[:5],
        "errors_alone": failed_alone[:5],
        "ttft_p50_s": _percentile(firsts, 0.5),
        "ttft_p95_s": _percentile(firsts, 0.95),
        "completion_tok_s": pieces / wall,
        "wall_s": wall,
        "server_peak_rss_gib": peak / 2**30 if peak else None,
        "server_peak_gpu_gib": gpu_peak / 2**30 if gpu_peak else None,
        "same_as_alone": same,
        "answers": [r[0] if r else None for r in results],
    }


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["scheme"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, label in (
        (axes[0], "ttft_p50_s", "time to first token, p50 (s)"),
        (axes[1], "ttft_p95_s", "time to first token, p95 (s)"),
        (axes[2], "completion_tok_s", "completion tokens/s, all clients"),
    ):
        ax.bar(names, [r[key] or 0 for r in rows])
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows) -> str:
    # the GPU's memory where nvidia-smi reported it, else the resident memory
    gpu = any(r.get("server_peak_gpu_gib") for r in rows)
    key = "server_peak_gpu_gib" if gpu else "server_peak_rss_gib"
    lines = [
        "| KV | completed | failed | TTFT p50 | TTFT p95 | completion tok/s | "
        + ("peak GPU GiB" if gpu else "peak RSS GiB")
        + " | same as alone |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        peak = f"{r[key]:.2f}" if r.get(key) else "—"
        same = (
            "—"
            if r["same_as_alone"] is None
            else f"{r['same_as_alone']}/{r['requests']}"
        )
        p50 = f"{r['ttft_p50_s']:.2f} s" if r["ttft_p50_s"] is not None else "—"
        p95 = f"{r['ttft_p95_s']:.2f} s" if r["ttft_p95_s"] is not None else "—"
        lines.append(
            f"| {r['scheme']} | {r['completed']}/{r['requests']} | {r['failed']} | "
            f"{p50} | {p95} | {r['completion_tok_s']:.1f} | {peak} | {same} |"
        )
    return "\n".join(lines)


def _lengths(text):
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: token counts, e.g. 256,1024"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: token counts of 1 or more")
    return values


def _checked(cast, ok, what):
    """An argparse type: ``cast`` of the text, which ``ok`` accepts."""

    def parse(text):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r}: {what}")
        return value

    return parse


_positive = _checked(int, lambda n: n >= 1, "a whole number, 1 or more")
_share = _checked(float, lambda x: 0 <= x <= 1, "a share, 0 to 1")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m omlx_cache loadbench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--kv", action="append", type=scheme, help="a scheme (repeat)")
    parser.add_argument("--clients", type=_positive, default=16)
    parser.add_argument("--requests", type=_positive, default=32)
    parser.add_argument("--lengths", type=_lengths, default=[256, 1024])
    parser.add_argument("--shared", type=_share, default=0.5)
    parser.add_argument("--max-tokens", type=_positive, default=32)
    parser.add_argument("--text", default=str(DEFAULT_TEXT))
    parser.add_argument("--check", action="store_true", help="answers against alone")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--plot")
    opts = parser.parse_args(argv)
    if not Path(opts.text).is_file():
        parser.error(f"--text {opts.text}: no such file")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    text = Path(opts.text).read_text()
    requests = make_requests(
        tokenizer, text, opts.requests, opts.lengths, opts.shared, opts.seed
    )
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "model": opts.model,
        "clients": opts.clients,
        "requests": opts.requests,
        "lengths": opts.lengths,
        "shared": opts.shared,
        "max_tokens": opts.max_tokens,
        "date": time.strftime("%Y-%m-%d"),
        "rows": [],
    }
    rows = record["rows"]
    for name in opts.kv or ["fp16"]:
        rows.append(run_scheme(opts.model, name, requests, opts, out.parent))
        print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        # after every scheme: a run cut short keeps what it measured
        out.write_text(json.dumps(record, indent=1))
    print(table(rows))
    if opts.plot:
        plot(rows, opts.plot)
    return rows


if __name__ == "__main__":
    main()
