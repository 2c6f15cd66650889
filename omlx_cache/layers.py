"""Which layers to give more bits: a rule from a short calibration text.

    python -m omlx_cache.layers --model models/gemma-3-270m-f32 \\
        --kv 4+rotate+center+exact16 --top 1 --out docs/data/layers-gemma3.json

A scheme's error is not spread evenly over a model's layers (on Gemma-3-270M
the one global layer 11 holds a quarter of the 4-bit error). For each layer
alone, ``layer_errors`` stores that layer's keys and values as the scheme
does and every other layer unquantized, and measures the mean KL divergence
of the next-token distribution against fp16 KV on a calibration text (by
default windows of the evaluation text after the tokens ``omlx_cache.eval``
scores, so the two do not overlap). The layers with the largest errors are
the ones to store with more bits: the command prints the scheme with the
``top`` of them at ``--bits`` (``+k8@11``: keys of layer 11 at 8 bits;
``--part kv``: keys and values).
"""

import argparse
import json
import sys
import time
from pathlib import Path

from mlx_lm.models.cache import make_prompt_cache

from . import eval as kv_eval
from . import schemes as kv_schemes


def layer_errors(
    model, windows, scheme: kv_schemes.Scheme, chunk: int = 128, progress=None
):
    """Mean KLD against fp16 KV with ``scheme`` in one layer at a time, one
    value per layer, over ``windows``. ``progress``: an ``eval.Progress`` of
    (layers + 1) * windows passes, stepped after each."""

    def window_logprobs(tokens, cache, label):
        logprobs = kv_eval.window_logprobs(model, tokens, cache, chunk)
        if progress:
            progress.label = label
            progress.step()
        return logprobs

    references = [window_logprobs(w, make_prompt_cache(model), "fp16") for w in windows]
    num_layers = len(make_prompt_cache(model))
    errors = []
    for layer in range(num_layers):
        klds = []
        for tokens, reference in zip(windows, references):
            cache = make_prompt_cache(model)
            cache[layer] = scheme.make_cache(model)[layer]
            logprobs = window_logprobs(tokens, cache, f"layer {layer}")
            _, kld, _ = kv_eval.token_stats(logprobs, tokens[1:], reference)
            klds.append(kld)
        errors.append(sum(float(k.mean()) for k in klds) / len(klds))
    return errors


def top_layers(errors, top: int) -> list[int]:
    """The ``top`` layers with the largest errors, in layer order."""
    ranked = sorted(range(len(errors)), key=lambda i: -errors[i])
    return sorted(ranked[:top])


def with_layers(name: str, layers, bits: int, part: str = "k") -> str:
    """``name`` with ``layers`` at ``bits`` (``+k8@11.19``)."""
    if not layers:
        return name
    suffix = f"+{part}{bits}@{'.'.join(map(str, layers))}"
    head, slash, groups = name.partition("/")
    return head + suffix + slash + groups


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m omlx_cache.layers",
        description="Per-layer error of a KV cache scheme; which layers to give more bits.",
    )
    parser.add_argument("--model", default=str(kv_eval.DEFAULT_MODEL))
    parser.add_argument("--kv", required=True, metavar="SCHEME", help="base scheme")
    parser.add_argument("--text", default=str(kv_eval.DEFAULT_TEXT))
    parser.add_argument(
        "--skip",
        type=int,
        default=100_000,
        help="tokens of the text skipped first (default 100000: past what "
        "omlx_cache.eval scores)",
    )
    parser.add_argument("--windows", type=int, default=1)
    parser.add_argument("--window-tokens", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--top", type=int, default=1, help="layers to give more bits")
    parser.add_argument("--bits", type=int, default=8, help="their bits (default 8)")
    parser.add_argument("--part", choices=("k", "kv"), default="k")
    parser.add_argument("--dtype", choices=sorted(kv_eval.DTYPES))
    parser.add_argument("--out", help="write the errors to this JSON file")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    scheme = kv_schemes.get_scheme(args.kv)
    model, tokenizer = kv_eval.load_model(args.model)
    if args.dtype:
        model.set_dtype(kv_eval.DTYPES[args.dtype])
    tokens = kv_eval.encode(tokenizer, kv_eval.read_text(args.text))[args.skip :]
    windows = kv_eval.make_windows(
        tokens, args.windows, args.window_tokens, tokenizer.bos_token_id
    )
    if hint := kv_eval.blas_hint():
        print(hint, file=sys.stderr)
    tic = time.perf_counter()
    num_layers = len(make_prompt_cache(model))
    progress = kv_eval.Progress((num_layers + 1) * len(windows))
    errors = layer_errors(model, windows, scheme, args.chunk, progress)
    progress.close()
    layers = top_layers(errors, args.top)
    report = {
        "model": args.model,
        "kv": args.kv,
        "text": args.text,
        "skip": args.skip,
        "windows": args.windows,
        "window_tokens": args.window_tokens,
        "chunk": args.chunk,
        "dtype": args.dtype or kv_eval.model_dtype(model),
        "layer_kld": errors,
        "share": [e / sum(errors) for e in errors],
        "top": layers,
        "scheme": with_layers(args.kv, layers, args.bits, args.part),
        "seconds": time.perf_counter() - tic,
        "versions": kv_eval.versions(),
    }
    for i, (e, share) in enumerate(zip(errors, report["share"])):
        print(f"layer {i:3d}  KLD {e:.5f}  {100 * share:5.1f}%")
    print(f"scheme: {report['scheme']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
