"""Total decode throughput of mlx-lm's BatchGenerator with n concurrent streams, per KV scheme.

    python -m omlx_cache.batchbench --model models/SmolLM2-135M-Instruct-f32 \\
        --streams 1,4,8 --kv fp16 --kv 8,4 --kv 4 --out build/batchbench.json

Schemes as ``omlx_cache.kv.spec`` takes them; each stream's caches are the
scheme's (``make_cache``), batched by ``BatchGenerator`` as the server batches
them. `--max-kv-size N` bounds every stream's context to N tokens, as
`mlx_lm.server --max-kv-size N` does.
"""

import argparse
import json
import sys
import time
from pathlib import Path

from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from .kv.spec import KVSpec

PROMPTS = [
    "Write a story about Einstein",
    "What is the capital of France?",
    "Explain how a bicycle works.",
    "List three primary colors.",
    "Why is the sky blue?",
    "Describe a cat in one sentence.",
    "What is 12 times 12?",
    "Name a famous painter.",
]


def run(model, tokenizer, n, spec, max_tokens, max_kv_size=None):
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            tokenize=True,
            add_generation_prompt=True,
        )
        for i in range(n)
    ]
    gen = BatchGenerator(
        model, max_tokens=max_tokens, completion_batch_size=n, max_kv_size=max_kv_size
    )
    gen.insert(prompts, caches=[spec.make_cache(model, max_kv_size) for _ in prompts])
    tic, first, tokens = time.perf_counter(), None, 0
    while responses := gen.next_generated():
        if first is None:
            first = time.perf_counter()  # prefill done, first tokens out
        tokens += len(responses)
    toc = time.perf_counter()
    return {
        "streams": n,
        "kv": str(spec),
        "max_kv_size": max_kv_size,
        "tokens": tokens,
        "prefill_s": first - tic,
        "decode_tok_s": (tokens - n) / (toc - first),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m omlx_cache.batchbench")
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct-f32")
    parser.add_argument("--streams", default="1,4,8")
    parser.add_argument("--kv", action="append", help="a scheme (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-kv-size", type=int, help="bounded context (tokens)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    try:
        schemes = [KVSpec.parse(k) for k in args.kv or ["fp16", "8,4", "4"]]
    except ValueError as e:
        parser.error(f"--kv: {e}")
    model, tokenizer = load(args.model)
    run(model, tokenizer, 1, KVSpec(), 4)  # warm-up
    rows = []
    for n in map(int, args.streams.split(",")):
        for spec in schemes:
            row = run(model, tokenizer, n, spec, args.max_tokens, args.max_kv_size)
            print(
                f"streams {n} kv {row['kv']}: {row['decode_tok_s']:.1f} tok/s",
                file=sys.stderr,
            )
            rows.append(row)
    print(
        "| streams | KV | decode tok/s (all streams) | prefill s |\n|---:|---|---:|---:|"
    )
    for r in rows:
        print(
            f"| {r['streams']} | {r['kv']} | {r['decode_tok_s']:.1f} | {r['prefill_s']:.2f} |"
        )
    if args.out:
        result = {"model": args.model, "max_kv_size": args.max_kv_size, "rows": rows}
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
