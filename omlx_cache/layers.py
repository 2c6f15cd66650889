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
``--part kv``: keys and values). ``--apply`` names the scheme the layers go
to when it is not the calibrated one (calibrate the keys alone with 16-bit
values, give the layers to the scheme with quantized values), and
``--budget`` takes as many of the ranked layers as keep that scheme within
so many bits per element (``schemes.average_bits`` at 4,096 tokens)::

    python -m omlx_cache.layers --model models/SmolLM2-135M-Instruct-f32 \\
        --kv codebook-4k-16v+center+qscale+exact8 \\
        --apply codebook-4+center+qscale+exact8 --bits 5 --budget 4.6
"""

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
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


def scheme_bits(model, name: str, context: int = kv_eval.AVERAGE_CONTEXT):
    """Mean of the (key, value) bits per element ``name``'s caches store for
    a sequence of ``context`` tokens (``schemes.average_bits``), from caches
    that have seen a few tokens (a codebook cache learns its head dims);
    None for caches it cannot count."""
    cache = kv_schemes.get_scheme(name).make_cache(model)
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=cache))
    bits = kv_schemes.average_bits(cache, context)
    return None if bits is None else sum(bits) / 2


def check_budget(model, name: str, budget: float):
    """ValueError unless ``name`` alone fits in ``budget`` bits per element."""
    bits = scheme_bits(model, name)
    if bits is None:
        raise ValueError(f"{name}: its caches have no bits per element to budget.")
    if bits > budget:
        raise ValueError(
            f"{name} alone stores {bits:.3f} bits, over --budget {budget}."
        )


def layers_within(model, errors, name: str, bits: int, part: str, budget: float):
    """The most of the layers ranked by ``errors`` that, at ``bits``, keep
    ``name`` (which ``check_budget`` passed) within ``budget`` bits per
    element (``scheme_bits``), in layer order."""

    def fits(n):
        layers = top_layers(errors, n)
        return scheme_bits(model, with_layers(name, layers, bits, part)) <= budget

    low, high = 0, len(errors)  # fits(low); the largest n that fits is in low..high
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return top_layers(errors, low)


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
    parser.add_argument(
        "--apply",
        metavar="SCHEME",
        help="the scheme to give the layers to (default: --kv)",
    )
    parser.add_argument("--top", type=int, default=1, help="layers to give more bits")
    parser.add_argument(
        "--budget",
        type=float,
        metavar="BITS",
        help="instead of --top: as many layers as keep the scheme within these "
        "bits per element at 4096 tokens",
    )
    parser.add_argument("--bits", type=int, default=8, help="their bits (default 8)")
    parser.add_argument("--part", choices=("k", "kv"), default="k")
    parser.add_argument("--dtype", choices=sorted(kv_eval.DTYPES))
    parser.add_argument("--out", help="write the errors to this JSON file")
    args = parser.parse_args(argv)
    for name in filter(None, (args.kv, args.apply)):
        try:
            kv_schemes.get_scheme(name)
        except ValueError as e:
            parser.error(str(e))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    scheme = kv_schemes.get_scheme(args.kv)
    target = args.apply or args.kv
    model, tokenizer = kv_eval.load_model(args.model)
    if args.dtype:
        model.set_dtype(kv_eval.DTYPES[args.dtype])
    tokens = kv_eval.encode(tokenizer, kv_eval.read_text(args.text))[args.skip :]
    windows = kv_eval.make_windows(
        tokens, args.windows, args.window_tokens, tokenizer.bos_token_id
    )
    if args.budget is not None:
        try:
            check_budget(model, target, args.budget)
        except ValueError as e:
            raise SystemExit(f"error: {e}")
    if hint := kv_eval.blas_hint():
        print(hint, file=sys.stderr)
    tic = time.perf_counter()
    num_layers = len(make_prompt_cache(model))
    progress = kv_eval.Progress((num_layers + 1) * len(windows))
    errors = layer_errors(model, windows, scheme, args.chunk, progress)
    progress.close()
    if args.budget is None:
        layers = top_layers(errors, args.top)
    else:
        layers = layers_within(model, errors, target, args.bits, args.part, args.budget)
    chosen = with_layers(target, layers, args.bits, args.part)
    report = {
        "model": args.model,
        "kv": args.kv,
        "apply": target,
        "budget": args.budget,
        "text": args.text,
        "skip": args.skip,
        "windows": args.windows,
        "window_tokens": args.window_tokens,
        "chunk": args.chunk,
        "dtype": args.dtype or kv_eval.model_dtype(model),
        "layer_kld": errors,
        "share": [e / sum(errors) for e in errors],
        "top": layers,
        "scheme": chosen,
        "bits_per_element": scheme_bits(model, chosen),
        "seconds": time.perf_counter() - tic,
        "versions": kv_eval.versions(),
    }
    for i, (e, share) in enumerate(zip(errors, report["share"])):
        print(f"layer {i:3d}  KLD {e:.5f}  {100 * share:5.1f}%")
    bits = report["bits_per_element"]
    print(f"scheme: {chosen}" + (f" ({bits:.3f} bits at 4096 tokens)" if bits else ""))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
