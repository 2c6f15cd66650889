"""Generate text with a KV cache scheme chosen by name.

    python -m omlx_cache.generate --model models/gemma-3-270m --max-tokens 100 \\
        --kv cq4 --prompt "Write a haiku about the sea."

``mlx_lm.generate`` with the caches of a scheme (``omlx_cache.kv.spec``) as
its prompt cache, through mlx-lm's own generation loop. Options follow
``mlx_lm.generate``'s (``--prompt -`` reads standard input).
"""

import argparse
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate
from mlx_lm.sample_utils import make_sampler

from . import fit
from .kv.spec import KVSpec


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m omlx_cache.generate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", required=True, help="model path")
    parser.add_argument("--prompt", "-p", default="Hello", help="prompt, - for stdin")
    parser.add_argument("--kv", default="fp16", help="KV cache scheme (default fp16)")
    parser.add_argument(
        "--max-kv-size", type=int, help="keep at most this many tokens per layer"
    )
    parser.add_argument("--max-tokens", "-m", type=int, default=100)
    parser.add_argument("--temp", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="use the prompt as it is, not in the model's chat template",
    )
    args = parser.parse_args(argv)
    try:
        args.spec = KVSpec.parse(args.kv)
    except ValueError as e:
        parser.error(f"--kv {args.kv}: {e}")
    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    return args


def prompt_tokens(tokenizer, prompt: str, ignore_chat_template: bool):
    """The prompt as the model's chat template frames it, if it has one."""
    if ignore_chat_template or tokenizer.chat_template is None:
        return tokenizer.encode(prompt)
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def main(argv=None) -> str:
    args = parse_args(argv)
    if args.seed is not None:
        mx.random.seed(args.seed)
    model, tokenizer = load(args.model)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    return generate(
        model,
        tokenizer,
        prompt_tokens(tokenizer, prompt, args.ignore_chat_template),
        max_tokens=args.max_tokens,
        sampler=make_sampler(args.temp, args.top_p),
        prompt_cache=fit.resolve(args.spec, model).make_cache(model, args.max_kv_size),
        verbose=True,
    )


if __name__ == "__main__":
    main()
