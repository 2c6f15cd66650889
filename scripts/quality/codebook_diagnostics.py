"""Where the quantized caches' error comes from, on a real model.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
    .venv/bin/python scripts/quality/codebook_diagnostics.py --out docs/data/diagnostics-smollm2.json

- reconstruction: relative squared error of the stored keys and values of the
  first window (all layers), per rotation and bits, against their energy and
  against their energy about the per-head mean (what attention sees of keys:
  a constant added to every key shifts every score of a query alike), plain
  and centered (the mean of the first 128 tokens subtracted, as the cache
  does with --chunk 128);
- energy_in_mean: share of the energy of keys and values in the per-head mean;
- split: each diagnosed scheme with only its keys or only its values
  quantized (the other side unquantized), all layers;
- first_exact: each diagnosed scheme with the first token's key and value
  exact in attention (a probe: what keeping an attention-sink token
  unquantized would give);
- per_layer: each diagnosed scheme in one layer only (K and V, then K only),
  the other layers unquantized.

A diagnosed scheme is ``affine-B``, ``codebook-B`` (Hadamard rotation) with
``+center`` / ``+center-kv``; it runs as a ``CodebookKVCache`` with those codecs
(``affine-4+center`` stores what ``4+rotate+center`` stores).
"""

import argparse
import json
import re
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from omlx_cache import eval as kv_eval
from omlx_cache import schemes
from omlx_cache.center import first_write_mean
from omlx_cache.codebook import (
    ROTATIONS,
    Affine,
    Codebook,
    CodebookKVCache,
    Plain,
    rotate,
)

DEFAULT_SCHEMES = ("affine-4+center", "codebook-3+center", "codebook-4+center")


class FirstExact(CodebookKVCache):
    """A probe, not a cache to use: float attention over the dequantized cache
    with its first token's key and value as they came (exact)."""

    first = None

    def update_and_fetch(self, keys, values):
        if self.first is None:
            self.first = (keys[:, :, :1], values[:, :, :1])
        return super().update_and_fetch(keys, values)

    def scaled_dot_product_attention(
        self, queries, keys, values, scale, mask, sinks=None
    ):
        keys, values = self.dequantize(queries.dtype)
        keys, values = (
            mx.concatenate([exact, x[:, :, 1:]], axis=2)
            for exact, x in zip(self.first, (keys, values))
        )
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )


def stored_kv(model, tokens):
    """Keys and values of every layer for one window: (layers, H, T, D) each."""
    cache = [KVCache() for _ in model.layers]
    model(tokens[None, :-1], cache=cache)
    keys, values = zip(*(c.keys_and_values() for c in cache))
    return mx.concatenate(keys), mx.concatenate(values)


def relative_errors(x, bits, rotation, chunk=128):
    c = Codebook(bits, rotation)

    def error(y):
        decoded = rotate(c.decode(c.encode(y), mx.float32), rotation, inverse=True)
        return ((decoded - y) ** 2).sum()

    about_mean = ((x - x[:, :, 1:].mean(axis=2, keepdims=True)) ** 2).sum()
    centered = x - first_write_mean(x[:, :, :chunk])
    return {
        "vs_energy": (error(x) / (x**2).sum()).item(),
        "vs_energy_about_mean": (error(x) / about_mean).item(),
        "centered_vs_energy_about_mean": (error(centered) / about_mean).item(),
    }


def reconstruction(keys, values):
    return {
        f"{name} {bits}-bit {rotation}": relative_errors(x, bits, rotation)
        for name, x in (("K", keys), ("V", values))
        for bits in (3, 4)
        for rotation in ROTATIONS
    }


def energy_in_mean(x):
    """Per layer: the share of the energy of tokens 1.. in their per-head mean."""
    x = x[:, :, 1:]
    mean = x.mean(axis=2, keepdims=True)
    share = (mean**2).sum(axis=(1, 2, 3)) * x.shape[2] / (x**2).sum(axis=(1, 2, 3))
    return [round(v, 4) for v in share.tolist()]


def diagnosed(name):
    """(codec, center) of a diagnosed scheme name."""
    match = re.fullmatch(r"(affine|codebook)-(\d)(\+center(-kv)?)?", name)
    if not match:
        raise ValueError(
            f"Unknown diagnosed scheme {name!r}: affine-B or codebook-B, "
            "optionally +center or +center-kv."
        )
    bits = int(match[2])
    c = Affine(bits, 64) if match[1] == "affine" else Codebook(bits)
    return c, schemes.center_option(match[3], match[4])


def scheme(name, model, make_layer):
    """A scheme whose layer i gets ``make_layer(i)``, or the model's own
    unquantized cache when that is None."""

    def make_cache(model):
        plain = make_prompt_cache(model)
        return [make_layer(i) or plain[i] for i in range(len(plain))]

    return schemes.Scheme(name, make_cache, bits_per_element=(0.0, 0.0))


def summaries(model, windows, kv):
    results = kv_eval.evaluate_tokens(model, windows, [schemes.get_scheme("fp16"), *kv])
    return {
        r["kv"]: {k: r[k] for k in ("delta_ppl_pct", "kld", "top1")}
        for r in results[1:]
    }


def split(model, windows, names, cache_class=None, suffix=""):
    """Each scheme quantizing K and V, K only and V only (the other kept
    exact), with ``cache_class`` (default CodebookKVCache)."""
    cache_class = cache_class or CodebookKVCache
    kv = []
    for name in names:
        c, center = diagnosed(name)
        for label, k, v in (
            ("both", c, c),
            ("K only", c, Plain()),
            ("V only", Plain(), c),
        ):
            kv.append(
                scheme(
                    f"{name}, {label}{suffix}",
                    model,
                    lambda i, k=k, v=v, center=center: cache_class(k, v, center=center),
                )
            )
    return summaries(model, windows, kv)


def first_exact(model, windows, names):
    return split(model, windows, names, FirstExact, ", first token exact")


def per_layer(model, windows, name):
    c, center = diagnosed(name)
    layers = len(model.layers)
    kv = []
    for label, v in (("K and V", c), ("K only", Plain())):
        for layer in range(layers):

            def make_layer(i, layer=layer, v=v):
                return CodebookKVCache(c, v, center=center) if i == layer else None

            kv.append(scheme(f"{label} in layer {layer}", model, make_layer))
    return summaries(model, windows, kv)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(kv_eval.DEFAULT_MODEL))
    parser.add_argument("--text", default=str(kv_eval.DEFAULT_TEXT))
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--layer-windows", type=int, default=2)
    parser.add_argument(
        "--schemes",
        nargs="+",
        default=list(DEFAULT_SCHEMES),
        help="diagnosed schemes: affine-B or codebook-B [+center|+center-kv]",
    )
    parser.add_argument(
        "--per-layer",
        nargs="*",
        default=None,
        help="schemes swept one layer at a time (default: the first of --schemes)",
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    for name in args.schemes + (args.per_layer or []):
        diagnosed(name)
    per_layer_schemes = args.schemes[:1] if args.per_layer is None else args.per_layer

    model, tokenizer = kv_eval.load_model(args.model)
    tokens = kv_eval.encode(tokenizer, kv_eval.read_text(args.text))
    windows = kv_eval.make_windows(tokens, args.windows, 512, tokenizer.bos_token_id)
    keys, values = stored_kv(model, windows[0])
    report = {
        "model": args.model,
        "windows": args.windows,
        "layer_windows": args.layer_windows,
        "versions": kv_eval.versions(),
        "reconstruction": reconstruction(keys, values),
        "energy_in_mean": {"K": energy_in_mean(keys), "V": energy_in_mean(values)},
        "split": split(model, windows, args.schemes),
        "first_exact": first_exact(model, windows, args.schemes),
        "per_layer": {
            name: per_layer(model, windows[: args.layer_windows], name)
            for name in per_layer_schemes
        },
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
