"""What the disk tier (omlx_cache.disk_cache) buys: time to the first token
after a restart, and hit rates of a conversation across restarts.

``server`` runs the real ``mlx_lm.server`` on a converted model (CPU:
SmolLM2 float32) for each KV scheme (``--schemes``: ``fp16``, the model's own
caches, or a scheme of ``omlx_cache.kv.spec``, served with ``--kv-cache omlx
--kv-cache-config SCHEME``):

- TTFT: a shared prefix (about ``--prefix`` tokens of system prompt) and two
  questions. With the tier, a server answers the first, is stopped, and a new
  one answers the second (from the disk); without it, a fresh server answers
  the second (what a restart leaves). Times to the first streamed token, the
  greedy answers (which must be identical), tokens restored, disk bytes.
- conversation: ``--turns`` user turns with fixed assistant replies, the server
  restarted after each third of them, with and without the tier: prompt and
  cached tokens (hit rate) per part, bytes on disk.

``synthetic`` runs in one process on a random-weight model at a real shape (for
the GPU: ``--preset llama3-8b --prefix 32768``): a first prompt (prefix and one
suffix) is prefilled and stored, a new tier on the same directory (a restart)
restores the prefix for a second prompt (another suffix), with the page cache
of the block files dropped first (``posix_fadvise``) and again warm; against
a prefill from scratch: restore time, time to the first token, disk bytes per
token, and the greedy tokens (identical).

    python -m omlx_cache.disk_bench server --out docs/disk-cache-cpu.json
    python -m omlx_cache.disk_bench synthetic --preset llama3-8b --prefix 32768 \\
        --dir /tmp/disk-bench --out $OUT/disk-cache-gpu.json
"""

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

from . import unified_memory
from .bench.common import log, write_json
from .bench.models import REPO_ROOT
from .bench.run import device_info, versions
from .disk_cache import BLOCK_TOKENS_ENV, DiskPromptCache, wait_for_blocks
from .kv.spec import KVSpec

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
SCHEMES = ("fp16", "bits=8,4", "bits=4")
MiB = 1 << 20


def scheme(text: str) -> str:
    """A scheme (``KVSpec``) as given, checked (for argparse)."""
    try:
        KVSpec.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def server_args(text: str) -> tuple:
    """The server's arguments for a scheme: its own caches for ``fp16``, else
    omlx_cache's, named by module so that no install is needed."""
    if KVSpec.parse(text).is_reference:
        return ()
    return ("--kv-cache", "omlx_cache.factory:from_args", "--kv-cache-config", text)


def slug(text: str) -> str:
    """A scheme as a file name."""
    return re.sub(r"[^\w.,=-]+", "_", text)


# --- the server -------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m mlx_lm.server`` in its own process on 127.0.0.1, as ``make
    serve`` runs it (OpenBLAS preloaded when installed). ``env`` adds to the
    environment; ``prefix`` goes before the Python command (e.g. a resource
    limit)."""

    def __init__(self, model, log_dir, *args, env=None, prefix=(), timeout=180):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.log_path = Path(log_dir) / f"server-{port}.log"
        environ = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
        if OPENBLAS.exists():
            environ["LD_PRELOAD"] = str(OPENBLAS)
        command = [
            *prefix,
            sys.executable,
            "-m",
            "mlx_lm.server",
            "--model",
            str(model),
        ]
        command += ["--host", "127.0.0.1", "--port", str(port), *args]
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(
                command, env=environ, stdout=out, stderr=subprocess.STDOUT
            )
        self._wait_until_ready(timeout)

    def _wait_until_ready(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not start within {timeout} s")

    def log(self) -> str:
        return self.log_path.read_text()

    def lines(self, text: str) -> list[str]:
        return [line for line in self.log().splitlines() if text in line]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=60)

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def chat(url, messages, max_tokens=12) -> dict:
    """A greedy streamed chat completion: answer, seconds to its first token,
    usage."""
    import requests

    start = time.monotonic()
    response = requests.post(
        f"{url}/v1/chat/completions",
        json={
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        stream=True,
        timeout=3600,
    )
    response.raise_for_status()
    parts, first, usage = [], None, None
    for line in response.iter_lines():
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[len(b"data: ") :])
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            if choice["delta"].get("content"):
                first = first or time.monotonic() - start
                parts.append(choice["delta"]["content"])
    return {"answer": "".join(parts), "ttft_s": first, "usage": usage}


def cached_tokens(usage) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def disk_bytes(directory) -> int:
    return sum(p.stat().st_size for p in Path(directory).glob("*/*.safetensors"))


def restore_seconds(server: Server) -> float | None:
    """The last restore time the tier logged."""
    lines = server.lines("disk prompt cache: restored")
    return float(lines[-1].split(" in ")[-1].split()[0]) if lines else None


# --- prompts -------------------------------------------------------------------------


def document(tokenizer, n_tokens: int) -> str:
    """A system prompt of about ``n_tokens`` tokens."""
    sentences, text = [], ""
    i = 0
    while len(tokenizer.encode(text)) < n_tokens:
        sentences.append(
            f"Station {i} of the line opened in {1850 + i % 170} and serves "
            f"{10 + (7 * i) % 90} thousand riders a day from platform {1 + i % 12}."
        )
        i += 1
        text = " ".join(sentences)
    return text


QUESTIONS = ("Which station opened in 1867?", "How many riders does station 40 serve?")


def conversation(n_turns: int) -> list[tuple[str, str]]:
    """(user, assistant) turns with fixed replies."""
    topics = ["a picnic", "a garden", "a bike trip", "a book club", "a bake sale"]
    turns = []
    for t in range(n_turns):
        topic, people = topics[t % 5], 3 + t
        user = f"Turn {t}: how do I plan {topic} for {people} people on day {t + 1}?"
        reply = f"For {topic} with {people} people, book early and keep a list ({t})."
        turns.append((user, reply))
    return turns


# --- server measurements ----------------------------------------------------------------


def ttft_case(model, scheme, doc, work: Path, block_tokens: int) -> dict:
    """Second question's TTFT after a restart, with and without the tier."""
    args = server_args(scheme)
    ask = [
        [{"role": "system", "content": doc}, {"role": "user", "content": q}]
        for q in QUESTIONS
    ]
    env = {BLOCK_TOKENS_ENV: str(block_tokens)}
    cache_dir = work / f"cache-{slug(scheme)}"
    shutil.rmtree(cache_dir, ignore_errors=True)

    log(f"disk_bench: {scheme}: without the tier (a fresh server)")
    with Server(model, work, *args) as s:
        without = chat(s.url, ask[1])
    log(f"disk_bench: {scheme}: with the tier, first question")
    tier_args = (*args, "--prompt-cache-dir", str(cache_dir))
    with Server(model, work, *tier_args, env=env) as s:
        first = chat(s.url, ask[0])
        wait_for_blocks(cache_dir, first["usage"]["prompt_tokens"] // block_tokens, 600)
    stored = disk_bytes(cache_dir)
    log(f"disk_bench: {scheme}: restarted, second question")
    with Server(model, work, *tier_args, env=env) as s:
        with_tier = chat(s.url, ask[1])
        restore = restore_seconds(s)
    restored = cached_tokens(with_tier["usage"])
    return {
        "scheme": scheme,
        "prompt_tokens": with_tier["usage"]["prompt_tokens"],
        "restored_tokens": restored,
        "ttft_without_s": without["ttft_s"],
        "ttft_with_s": with_tier["ttft_s"],
        "speedup": without["ttft_s"] / with_tier["ttft_s"],
        "restore_s": restore,
        "identical": without["answer"] == with_tier["answer"],
        "answer_without": without["answer"],
        "answer_with": with_tier["answer"],
        "disk_bytes_first": stored,
        "first_prompt_tokens": first["usage"]["prompt_tokens"],
        "disk_bytes_per_token": stored / first["usage"]["prompt_tokens"],
    }


def conversation_case(model, scheme, turns, work: Path, block_tokens: int, tier: bool):
    """The turns in three parts, a server restart between parts."""
    args = server_args(scheme)
    cache_dir = work / f"chat-{slug(scheme)}"
    shutil.rmtree(cache_dir, ignore_errors=True)
    env = {BLOCK_TOKENS_ENV: str(block_tokens)}
    if tier:
        args = (*args, "--prompt-cache-dir", str(cache_dir))
    system = {"role": "system", "content": "You are a helpful planning assistant."}
    bounds = [0, len(turns) // 3, 2 * len(turns) // 3, len(turns)]
    parts = []
    for part, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        log(f"disk_bench: {scheme}: conversation part {part + 1}, tier {tier}")
        rows = []
        with Server(model, work, *args, env=env) as s:
            for t in range(lo, hi):
                messages = [system]
                for user, assistant in turns[:t]:
                    messages += [
                        {"role": "user", "content": user},
                        {"role": "assistant", "content": assistant},
                    ]
                messages.append({"role": "user", "content": turns[t][0]})
                reply = chat(s.url, messages, max_tokens=8)
                usage = reply["usage"]
                rows.append((usage["prompt_tokens"], cached_tokens(usage)))
            if tier:
                # let the last turn's blocks land before the restart
                time.sleep(1.0)
                wait_for_blocks(cache_dir, rows[-1][0] // block_tokens, 600)
        prompt = sum(p for p, _ in rows)
        hit = sum(c for _, c in rows)
        parts.append(
            {
                "part": part + 1,
                "turns": f"{lo + 1}-{hi}",
                "prompt_tokens": prompt,
                "cached_tokens": hit,
                "hit_rate": hit / prompt,
                "first_turn_cached": rows[0][1],
                "first_turn_prompt": rows[0][0],
                "disk_bytes": disk_bytes(cache_dir) if tier else 0,
            }
        )
    return {"scheme": scheme, "tier": tier, "parts": parts}


def run_server(options) -> dict:
    from mlx_lm.utils import load_tokenizer

    model = Path(options.model)
    tokenizer = load_tokenizer(model)
    doc = document(tokenizer, options.prefix)
    work = Path(options.dir or tempfile.mkdtemp(prefix="disk-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    report = {"ttft": [], "conversation": []}
    try:
        for scheme in options.schemes:
            report["ttft"].append(
                ttft_case(model, scheme, doc, work, options.block_tokens)
            )
            print_ttft(report["ttft"][-1:])
        turns = conversation(options.turns)
        for scheme in options.schemes if options.turns else ():
            for tier in (False, True):
                case = conversation_case(
                    model, scheme, turns, work, options.block_tokens, tier
                )
                report["conversation"].append(case)
    finally:
        if not options.dir:
            shutil.rmtree(work, ignore_errors=True)
    report["model"] = str(model)
    report["prefix_tokens"] = options.prefix
    return report


# --- in process, random weights --------------------------------------------------------


def run_synthetic(options) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from .bench import PRESETS, build_model, lm_head

    preset = PRESETS[options.preset]
    dtype = getattr(mx, options.dtype or preset["dtype"])
    log(f"disk_bench: building {options.preset} ({dtype}) on {mx.default_device()}")
    model = build_model(preset, dtype)
    vocab = preset["config"]["vocab_size"]
    work = Path(options.dir or tempfile.mkdtemp(prefix="disk-bench-"))
    shutil.rmtree(work, ignore_errors=True)
    step = options.prefill_step

    prefix = mx.random.randint(
        0, vocab, (options.prefix,), key=mx.random.key(1)
    ).tolist()
    suffixes = [
        mx.random.randint(0, vocab, (options.suffix,), key=mx.random.key(k)).tolist()
        for k in (2, 3)
    ]

    def prefill(cache, tokens):
        """Logits of the last token, in chunks of ``step`` (as generate_step)."""
        for start in range(0, len(tokens), step):
            hidden = model.model(
                mx.array(tokens[start : start + step])[None], cache=cache
            )
            mx.eval(hidden, [c.state for c in cache])
        logits = lm_head(model, hidden[:, -1:, :])
        mx.eval(logits)
        return logits

    def greedy(cache, logits, n):
        tokens = [int(logits.argmax(-1).item())]
        for _ in range(n - 1):
            logits = lm_head(model, model.model(mx.array([[tokens[-1]]]), cache=cache))
            tokens.append(int(logits.argmax(-1).item()))
        return tokens

    key = ("synthetic", options.preset, str(dtype))
    rows = []
    log("disk_bench: warm-up")
    warm = make_prompt_cache(model)
    prefill(warm, prefix[: min(2 * step, len(prefix))])
    del warm
    for scheme in options.schemes:
        make_cache = KVSpec.parse(scheme).make_cache
        settings = {"scheme": scheme}
        directory = work / slug(scheme)
        log(f"disk_bench: {scheme}: first prompt, stored")
        cache = make_cache(model)
        prefill(cache, prefix + suffixes[0])
        tier = DiskPromptCache(
            directory, settings=settings, block_tokens=options.block_tokens
        )
        start = time.perf_counter()
        tier.insert(key, prefix + suffixes[0], cache)
        tier.flush()
        store_s = time.perf_counter() - start
        del cache
        stored = disk_bytes(directory)
        mx.clear_cache()

        log(f"disk_bench: {scheme}: second prompt from scratch")
        second = prefix + suffixes[1]
        start = time.perf_counter()
        cache = make_cache(model)
        logits = prefill(cache, second)
        ttft_without = time.perf_counter() - start
        answer_without = greedy(cache, logits, options.answer_tokens)
        del cache, logits
        mx.clear_cache()

        row = {
            "scheme": scheme,
            "prefix_tokens": len(prefix),
            "disk_bytes": stored,
            "disk_bytes_per_token": stored / len(prefix + suffixes[0]),
            "store_s": store_s,
            "ttft_without_s": ttft_without,
        }
        # "plain": warm, without moving the arrays to the GPU ahead of use
        cases = (
            ("cold", "warm", "plain") if options.compare_prefetch else ("cold", "warm")
        )
        for page_cache in cases:
            unified_memory.ENABLED = page_cache != "plain"
            log(
                f"disk_bench: {scheme}: second prompt restored ({page_cache} page cache)"
            )
            if page_cache == "cold":
                drop_page_cache(directory)
            restarted = DiskPromptCache(
                directory, settings=settings, block_tokens=options.block_tokens
            )
            start = time.perf_counter()
            cache, n = restarted.fetch(key, second, 0)
            mx.eval([c.state for c in cache])
            restore_s = time.perf_counter() - start
            logits = prefill(cache, second[n:])
            ttft_with = time.perf_counter() - start
            for phase, seconds in restarted.last_restore.items():
                row[f"{phase}_{page_cache}_s"] = seconds
            row[f"suffix_{page_cache}_s"] = ttft_with - restore_s
            answer_with = greedy(cache, logits, options.answer_tokens)
            row[f"restore_{page_cache}_s"] = restore_s
            row[f"ttft_with_{page_cache}_s"] = ttft_with
            row[f"speedup_{page_cache}"] = ttft_without / ttft_with
            row["restored_tokens"] = n
            row[f"identical_{page_cache}"] = answer_with == answer_without
            del cache, logits
            mx.clear_cache()
        rows.append(row)
        print_synthetic(rows[-1:])
        shutil.rmtree(directory, ignore_errors=True)
    if not options.dir:
        shutil.rmtree(work, ignore_errors=True)
    return {"preset": options.preset, "dtype": str(dtype), "synthetic": rows}


def drop_page_cache(directory):
    """Ask the kernel to drop the block files' pages (they are clean after
    the fsync), so that a restore reads the disk."""
    for path in Path(directory).glob("*/*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --- tables ---------------------------------------------------------------------------


def print_ttft(rows):
    print(
        "| KV | prompt tokens | restored | TTFT without tier (s) | with (s) | speedup "
        "| restore (s) | disk MB | bytes/token | same answer |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['scheme']} | {r['prompt_tokens']} | {r['restored_tokens']} "
            f"| {r['ttft_without_s']:.2f} | {r['ttft_with_s']:.2f} | {r['speedup']:.1f}x "
            f"| {r['restore_s'] or 0:.3f} | {r['disk_bytes_first'] / 1e6:.1f} "
            f"| {r['disk_bytes_per_token']:.0f} | {'yes' if r['identical'] else 'NO'} |"
        )


def print_conversation(cases):
    print(
        "| KV | disk tier | part (turns) | prompt tokens | cached | hit rate "
        "| first turn cached / prompt | disk MB |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for case in cases:
        for p in case["parts"]:
            print(
                f"| {case['scheme']} | {'yes' if case['tier'] else 'no'} | {p['part']} "
                f"({p['turns']}) | {p['prompt_tokens']} | {p['cached_tokens']} "
                f"| {100 * p['hit_rate']:.1f}% | {p['first_turn_cached']} / "
                f"{p['first_turn_prompt']} | {p['disk_bytes'] / 1e6:.1f} |"
            )


def print_synthetic(rows):
    print(
        "| KV | prefix | disk MB | bytes/token | store (s) | restore cold (s) | warm (s) "
        "| TTFT scratch (s) | restored cold (s) | warm (s) | speedup cold | warm | same |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        same = r["identical_cold"] and r["identical_warm"]
        print(
            f"| {r['scheme']} | {r['prefix_tokens']} | {r['disk_bytes'] / 1e6:.1f} "
            f"| {r['disk_bytes_per_token']:.0f} | {r['store_s']:.2f} "
            f"| {r['restore_cold_s']:.2f} | {r['restore_warm_s']:.2f} "
            f"| {r['ttft_without_s']:.2f} | {r['ttft_with_cold_s']:.2f} "
            f"| {r['ttft_with_warm_s']:.2f} | {r['speedup_cold']:.1f}x "
            f"| {r['speedup_warm']:.1f}x | {'yes' if same else 'NO'} |"
        )
    for r in rows:
        for case in ("cold", "warm", "plain"):
            if f"blocks_{case}_s" not in r:
                continue
            phases = ", ".join(
                f"{phase} {r.get(f'{phase}_{case}_s', 0.0):.3f}"
                for phase in ("allocate", "blocks", "read", "check", "assemble")
            )
            print(
                f"  {r['scheme']} {case}: {phases} s (read, check: summed over "
                f"threads), restore {r[f'restore_{case}_s']:.3f} s, "
                f"suffix {r[f'suffix_{case}_s']:.3f} s, "
                f"first token {r[f'ttft_with_{case}_s']:.3f} s "
                f"({r[f'speedup_{case}']:.1f}x)"
            )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    server = sub.add_parser("server", help="the real server on a converted model")
    server.add_argument(
        "--model", default=str(REPO_ROOT / "models/SmolLM2-135M-Instruct-f32")
    )
    server.add_argument("--prefix", type=int, default=2048, help="system prompt tokens")
    server.add_argument("--turns", type=int, default=20, help="0: no conversation")
    synthetic = sub.add_parser("synthetic", help="in process, random weights")
    synthetic.add_argument("--preset", default="tiny-cpu")
    synthetic.add_argument("--dtype", default=None)
    synthetic.add_argument("--prefix", type=int, default=2048)
    synthetic.add_argument("--suffix", type=int, default=32)
    synthetic.add_argument("--prefill-step", type=int, default=2048)
    synthetic.add_argument("--answer-tokens", type=int, default=8)
    synthetic.add_argument(
        "--compare-prefetch",
        action="store_true",
        help="also restore warm without moving the arrays to the GPU ahead of use",
    )
    for p in (server, synthetic):
        p.add_argument(
            "--schemes",
            nargs="+",
            type=scheme,
            default=list(SCHEMES),
            help="fp16 or omlx_cache.kv schemes, one argument each "
            "(e.g. 'bits=8,4' 'q4')",
        )
        p.add_argument("--block-tokens", type=int, default=256)
        p.add_argument(
            "--dir", default=None, help="work directory (default: a temporary one)"
        )
        p.add_argument("--out", default=None, help="JSON report")
    options = parser.parse_args(argv)
    started = datetime.now(UTC)
    report = run_server(options) if options.mode == "server" else run_synthetic(options)
    report.update(
        {
            "mode": options.mode,
            "date": started.isoformat(timespec="seconds"),
            "seconds": (datetime.now(UTC) - started).total_seconds(),
            "command": " ".join(["python -m omlx_cache.disk_bench", *sys.argv[1:]]),
            "block_tokens": options.block_tokens,
            "device": device_info(),
            "versions": versions(),
        }
    )
    print()
    if options.mode == "server":
        print_ttft(report["ttft"])
        print()
        print_conversation(report["conversation"])
    else:
        print_synthetic(report["synthetic"])
    if options.out:
        write_json(options.out, report)
        log(f"disk_bench: wrote {options.out}")
    return report


if __name__ == "__main__":
    main()
