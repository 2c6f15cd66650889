"""Greedy answers of KV schemes to one chat prompt, by the size of the cache's first write.

    .venv/bin/python scripts/quality/first_write_probe.py \\
        --model models/SmolLM2-135M-Instruct-f32 --kv 4+rotate+exact16 \\
        --kv 4+rotate+center+qscale+exact16 --kv codebook-4+center

A centered or weighted cache takes its means and key weights from its first write.
The server's prompt cache makes that write short (a request that continues a cached
prefix); this prints each scheme's answer from a fresh cache (the whole prompt as the
first write) and after first writes of ``--first`` tokens, and the log-probabilities
of the first answer token's ``--top`` candidates from a fresh cache: how close the
answer is to another.
"""

import argparse

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

from omlx_cache.schemes import get_scheme


def answer(model, tokenizer, prompt, cache, first, max_tokens):
    if first:
        model(mx.array([prompt[:first]]), cache=cache)
    steps = generate_step(
        mx.array(prompt[first:]), model, prompt_cache=cache, max_tokens=max_tokens
    )
    return tokenizer.decode([int(token) for token, _ in steps])


def first_token_logprobs(model, tokenizer, prompt, cache, top):
    """The ``top`` likeliest first answer tokens and their log-probabilities."""
    logits = model(mx.array([prompt]), cache=cache)[0, -1].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits)
    best = mx.argsort(-logprobs)[:top].tolist()
    return ", ".join(
        f"{tokenizer.decode([t])!r} {logprobs[t].item():.2f}" for t in best
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--kv", action="append", required=True)
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--first", type=int, nargs="+", default=[8, 26])
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--top", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    messages = [{"role": "user", "content": args.prompt}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    print(f"{len(prompt)} prompt tokens")
    for name in args.kv:
        scheme = get_scheme(name)
        candidates = first_token_logprobs(
            model, tokenizer, prompt, scheme.make_cache(model), args.top
        )
        print(f"{name} | first token: {candidates}", flush=True)
        for first in [0, *args.first]:
            text = answer(
                model,
                tokenizer,
                prompt,
                scheme.make_cache(model),
                first,
                args.max_tokens,
            )
            label = "fresh" if first == 0 else f"first write {first}"
            print(f"{name} | {label}: {text!r}", flush=True)


if __name__ == "__main__":
    main()
