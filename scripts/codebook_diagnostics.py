"""Where the codebook cache's error comes from, on a real model.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
    .venv/bin/python scripts/codebook_diagnostics.py --out docs/codebook-diagnostics.json

- reconstruction: relative squared error of the stored keys and values of the
  first window (all layers), per rotation and bits, against their energy and
  against their energy about the per-head mean (what attention sees of keys:
  a constant added to every key shifts every score of a query alike);
- energy_in_mean: share of the energy of keys and values in the per-head mean;
- per_layer: KLD and delta-PPL vs fp16 with 3-bit codebook keys in one layer
  only (values and other layers unquantized);
- centered: the cache with each head's mean key (of the first chunk, BOS
  left out) subtracted before quantization, a probe of how much of the key
  error is the mean's.
"""

import argparse
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from omlx_cache import eval as kv_eval
from omlx_cache import schemes
from omlx_cache.codebook import (
    ROTATIONS,
    Codebook,
    CodebookKVCache,
    Plain,
    rotate,
)


class CenteredKeys(CodebookKVCache):
    """A probe, not a cache to use: keys minus their per-head mean of the first
    chunk (softmax-invariant without sinks)."""

    key_mean = None

    def _quantize(self, keys, values):
        if self.key_mean is None:
            first = keys[:, :, 1:] if keys.shape[2] > 1 else keys
            self.key_mean = first.mean(axis=2, keepdims=True)
        return super()._quantize(keys - self.key_mean, values)


def stored_kv(model, tokens):
    """Keys and values of every layer for one window: (layers, H, T, D) each."""
    cache = [KVCache() for _ in model.layers]
    model(tokens[None, :-1], cache=cache)
    keys, values = zip(*(c.keys_and_values() for c in cache))
    return mx.concatenate(keys), mx.concatenate(values)


def relative_errors(x, bits, rotation):
    c = Codebook(bits, rotation)
    decoded = rotate(c.decode(c.encode(x), mx.float32), rotation, inverse=True)
    error = ((decoded - x) ** 2).sum()
    centered = x - x[:, :, 1:].mean(axis=2, keepdims=True)
    return {
        "vs_energy": (error / (x**2).sum()).item(),
        "vs_energy_about_mean": (error / (centered**2).sum()).item(),
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


def scheme(name, make_layer, layers):
    def make_cache(model):
        return [make_layer(i) for i in range(layers)]

    return schemes.Scheme(name, make_cache, bits_per_element=(0.0, 0.0))


def summaries(model, windows, kv):
    results = kv_eval.evaluate_tokens(model, windows, [schemes.get_scheme("fp16"), *kv])
    return {
        r["kv"]: {k: r[k] for k in ("delta_ppl_pct", "kld", "top1")}
        for r in results[1:]
    }


def per_layer(model, windows, layers):
    def only(layer):
        return lambda i: CodebookKVCache(3, Plain()) if i == layer else KVCache()

    kv = [scheme(f"K3 in layer {i}", only(i), layers) for i in range(layers)]
    return summaries(model, windows, kv)


def centered(model, windows, layers):
    kv = [
        scheme(name, lambda i, k=k, v=v, c=c: c(k, v), layers)
        for name, c, k, v in [
            ("codebook-3", CodebookKVCache, 3, 3),
            ("codebook-3, keys centered", CenteredKeys, 3, 3),
            ("codebook-3k-16v", CodebookKVCache, 3, Plain()),
            ("codebook-3k-16v, keys centered", CenteredKeys, 3, Plain()),
            ("codebook-4", CodebookKVCache, 4, 4),
            ("codebook-4, keys centered", CenteredKeys, 4, 4),
        ]
    ]
    return summaries(model, windows, kv)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(kv_eval.DEFAULT_MODEL))
    parser.add_argument("--text", default=str(kv_eval.DEFAULT_TEXT))
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--layer-windows", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()

    model, tokenizer = kv_eval.load_model(args.model)
    tokens = kv_eval.encode(tokenizer, kv_eval.read_text(args.text))
    windows = kv_eval.make_windows(tokens, args.windows, 512, tokenizer.bos_token_id)
    layers = len(model.layers)
    keys, values = stored_kv(model, windows[0])
    report = {
        "model": args.model,
        "windows": args.windows,
        "layer_windows": args.layer_windows,
        "reconstruction": reconstruction(keys, values),
        "energy_in_mean": {"K": energy_in_mean(keys), "V": energy_in_mean(values)},
        "centered": centered(model, windows, layers),
        "per_layer": per_layer(model, windows[: args.layer_windows], layers),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
