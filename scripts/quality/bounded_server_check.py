"""Greedy answers of the real mlx_lm.server to prompts longer than its window.

    .venv/bin/python scripts/quality/bounded_server_check.py \
        --model models/gemma-3-270m-f32 --out docs/data/bounded-server-gemma3.json

For each prompt ("The quick brown fox jumps over the lazy dog. " repeated, then a
question) and each KV scheme (fp16, 8, 4, 4 with --kv-rotate), starts the server on
127.0.0.1 with and without --max-kv-size, asks once at temperature 0 and prints the
answer. A model with a chat template is asked through /v1/chat/completions, a base
model through /v1/completions. Prints whether each scheme's answer equals fp16's.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
SCHEMES = {
    "fp16": (),
    "8": ("--kv-bits", "8"),
    "4": ("--kv-bits", "4"),
    "4+rotate": ("--kv-bits", "4", "--kv-rotate"),
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model, hub, *flags):
    """A server process on a free port and its URL, once it answers /health."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub))
    if OPENBLAS.exists():
        env["LD_PRELOAD"] = str(OPENBLAS)
    command = [sys.executable, "-m", "mlx_lm", "server", "--model", model]
    proc = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port), *flags],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: {command}")
        try:
            if requests.get(f"{url}/health", timeout=1).ok:
                return proc, url
        except requests.ConnectionError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start within 300 s")


def ask(url, text, chat, max_tokens):
    body = {"max_tokens": max_tokens, "temperature": 0.0}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        path = "chat/completions"
    else:
        body["prompt"] = text + "\nAnswer:"
        path = "completions"
    reply = requests.post(f"{url}/v1/{path}", json=body, timeout=1800)
    reply.raise_for_status()
    reply = reply.json()
    choice = reply["choices"][0]
    answer = choice["message"]["content"] if chat else choice["text"]
    return reply["usage"]["prompt_tokens"], answer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--window", type=int, default=128, help="--max-kv-size")
    parser.add_argument(
        "--repeats",
        default="25,120",
        help="sentence repeats per prompt, comma-separated",
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--hub", default="models/hub", help="HF_HUB_CACHE folder")
    parser.add_argument("--out", help="JSON file for the answers")
    args = parser.parse_args(argv)

    config = json.loads((Path(args.model) / "tokenizer_config.json").read_text())
    chat = bool(config.get("chat_template"))
    Path(args.hub).mkdir(parents=True, exist_ok=True)
    rows = []
    for repeats in map(int, args.repeats.split(",")):
        text = "The quick brown fox jumps over the lazy dog. " * repeats
        text += "\nQuestion: What animal jumps?"
        for window in (args.window, None):
            bound = ("--max-kv-size", str(window)) if window else ()
            for scheme, flags in SCHEMES.items():
                proc, url = start(args.model, args.hub, *bound, *flags)
                try:
                    tokens, answer = ask(url, text, chat, args.max_tokens)
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
                row = {
                    "repeats": repeats,
                    "prompt_tokens": tokens,
                    "window": window,
                    "scheme": scheme,
                    "answer": answer,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)

    print("\nprompt tokens | window | scheme | same as fp16 | answer")
    for row in rows:
        fp16 = next(
            r["answer"]
            for r in rows
            if (r["repeats"], r["window"], r["scheme"])
            == (row["repeats"], row["window"], "fp16")
        )
        same = "yes" if row["answer"] == fp16 else "no"
        print(
            f"{row['prompt_tokens']} | {row['window'] or '-'} | {row['scheme']} | "
            f"{same} | {row['answer']!r}"
        )
    if args.out:
        out = {"model": args.model, "max_tokens": args.max_tokens, "rows": rows}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
