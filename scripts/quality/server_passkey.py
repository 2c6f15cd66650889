"""Passkey retrieval through the real mlx_lm.server, one server per KV setting.

    python scripts/quality/server_passkey.py --model models/gemma-3-270m \\
        --kv fp16= --kv "4=--kv-bits 4" --kv "q4=--kv-cache omlx --kv-cache-config q4" \\
        --context 8192 --depths 8 --keys 3 --out docs/data/server-passkey-gemma3.json

Each ``--kv NAME=FLAGS`` starts ``python -m mlx_lm.server`` on 127.0.0.1 with
those flags (and ``--prompt-cache-size 0``: every prompt computed from
scratch), sends each passkey prompt of ``omlx_cache.eval`` (the same keys,
depths and filler) as a plain completion at temperature 0 and counts the
answers that contain the key. ``--alone`` sends a seed with each request,
which the server serves on its own instead of through its batch generator.
Settings after the first are paired with the first's trials (keys lost and
gained, McNemar p). Prints a table and writes JSON.
"""

import argparse
import json
import shlex
import sys
import time
import urllib.request
from pathlib import Path

from mlx_lm.utils import load_tokenizer

from omlx_cache.disk_bench import Server
from omlx_cache.eval import paired_outcomes, passkey_depths, passkey_prompts


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--kv",
        action="append",
        required=True,
        metavar="NAME=FLAGS",
        help="a server setting: its name and the server flags that make it "
        "(the first is the reference)",
    )
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--depths", type=int, default=8)
    parser.add_argument("--keys", type=int, default=3, help="passkeys per depth")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--alone",
        action="store_true",
        help="requests with a seed: served one at a time, not as a batch",
    )
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    settings = {}
    for spec in args.kv:
        name, sep, flags = spec.partition("=")
        if not sep or not name:
            parser.error(f"--kv {spec!r}: expected NAME=FLAGS")
        settings[name] = shlex.split(flags)
    args.settings = settings
    return args


def prompts(tokenizer, context, depths, keys):
    """(key, depth, prompt text) of each trial, as ``omlx_cache.eval`` makes
    them (the text decoded from its tokens; the server encodes it again)."""
    return [
        (p.key, p.depth, tokenizer.decode(p.tokens))
        for p in passkey_prompts(tokenizer, context, passkey_depths(depths), keys)
    ]


def complete(url, text, max_tokens, alone=False) -> dict:
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0}
    if alone:
        body["seed"] = 0
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def run_setting(model, flags, trials, args) -> list[dict]:
    runs = []
    with Server(model, args.log_dir, "--prompt-cache-size", "0", *flags) as server:
        for n, (key, depth, text) in enumerate(trials, 1):
            start = time.monotonic()
            reply = complete(server.url, text, args.max_tokens, args.alone)
            answer = reply["choices"][0]["text"]
            runs.append(
                {
                    "key": key,
                    "depth": depth,
                    "prompt_tokens": reply["usage"]["prompt_tokens"],
                    "answer": answer,
                    "correct": key in answer,
                    "seconds": round(time.monotonic() - start, 3),
                }
            )
            print(f"  {n}/{len(trials)} depth {depth:.2f}: {answer!r}", flush=True)
    return runs


def main(argv=None):
    args = parse_args(argv)
    tokenizer = load_tokenizer(Path(args.model))
    trials = prompts(tokenizer, args.context, args.depths, args.keys)
    results = []
    for name, flags in args.settings.items():
        print(f"[server_passkey] {name}: {' '.join(flags) or '(no flags)'}", flush=True)
        runs = run_setting(args.model, flags, trials, args)
        result = {"name": name, "flags": flags, "runs": runs}
        result["correct"] = sum(r["correct"] for r in runs)
        if results:
            result["vs_reference"] = paired_outcomes(results[0]["runs"], runs)
        results.append(result)

    print(f"\n| KV | server flags | keys found of {len(trials)} | lost / gained | p |")
    print("|---|---|---|---|---|")
    for r in results:
        paired = r.get("vs_reference")
        versus = f"{paired['lost']} / {paired['gained']}" if paired else "ref"
        p = f"{paired['p']:.3f}" if paired else ""
        print(
            f"| {r['name']} | {' '.join(r['flags'])} | {r['correct']} | {versus} | {p} |"
        )
    if args.out:
        report = {
            "command": " ".join(sys.argv),
            "model": args.model,
            "context": args.context,
            "depths": args.depths,
            "keys": args.keys,
            "alone": args.alone,
            "results": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
