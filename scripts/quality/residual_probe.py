"""Probe: what a full-precision recent window (KIVI's residual) adds to kept first tokens.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
    .venv/bin/python scripts/quality/residual_probe.py docs/data/residual-probe-smollm2.json \\
        4+rotate+center+exact16:0:64 4+rotate+center+exact16:64:64

Each argument after the output file is ``SCHEME:R:B``: an affine scheme of
``omlx_cache.schemes`` stored as it stores it (``keep_exact`` included), with
the recent tokens kept as they came, as a residual of ``R`` tokens quantized a
block of ``B`` at a time would keep them: the tokens from
``floor((offset - R) / B) * B`` on (``R`` to ``R + B - 1`` of them). A probe,
not a cache to use: it keeps a float copy of every token and attends in float
over the dequantized keys and values with the kept and recent tokens
replaced by their copies. SmolLM2, WikiText-2, 4 windows of 512 tokens in
128-token chunks, as ``omlx_cache.eval`` runs them.
"""

import json
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache, kv_rotate

from omlx_cache import eval as ev
from omlx_cache import schemes
from omlx_cache.center import _Centered


class Residual(QuantizedKVCache):
    R = 0
    B = 64
    _float = None

    def update_and_fetch(self, keys, values):
        k, v = self._transform(keys, values)
        if self._float is None:
            self._float = (k, v)
        else:
            self._float = tuple(
                mx.concatenate([a, b], axis=2) for a, b in zip(self._float, (k, v))
            )
        return super().update_and_fetch(keys, values)

    def scaled_dot_product_attention(
        self, queries, keys, values, scale, mask, sinks=None
    ):
        kq, vq = self.keys_and_values()
        k = mx.dequantize(*kq, group_size=self.key_group_size, bits=self.key_bits)
        v = mx.dequantize(*vq, group_size=self.value_group_size, bits=self.value_bits)
        n = self.offset
        pos = mx.arange(n)[None, None, :, None]
        start = max(0, (n - self.R) // self.B * self.B) if self.R else n
        exact = (pos < self._exact_count()) | (pos >= start)
        k = mx.where(exact, self._float[0], k).astype(queries.dtype)
        v = mx.where(exact, self._float[1], v).astype(queries.dtype)
        if self.rotate_keys:
            queries = kv_rotate(queries)
        out = mx.fast.scaled_dot_product_attention(
            queries, k, v, scale=scale, mask=mask
        )
        if self.rotate_values:
            out = kv_rotate(out, inverse=True)
        return out


class CenteredResidual(_Centered, Residual):
    def __init__(self, *args, center="k", **kwargs):
        super().__init__(*args, **kwargs)
        self._require_center(center)


def probe_scheme(base, R, B):
    scheme = schemes.get_scheme(base)
    center = "+center" in base

    def make(model):
        caches = []
        for c in scheme.make_cache(model):
            cls = CenteredResidual if center else Residual
            kwargs = {
                "group_size": c.group_size,
                "bits": c.bits,
                "rotate": c.rotate,
                "keep_exact": c.keep_exact,
            }
            if center:
                kwargs["center"] = c.center
            probe = cls(**kwargs)
            probe.R, probe.B = R, B
            caches.append(probe)
        return caches

    return schemes.Scheme(
        f"{base}+res{R}/b{B}",
        make,
        scheme.bits_per_element,
        scheme.group_size,
        kept_tokens=scheme.kept_tokens,
    )


def main():
    model, tok = ev.load_model("models/SmolLM2-135M-Instruct-f32")
    tokens = ev.encode(tok, ev.read_text(ev.DEFAULT_TEXT))
    windows = ev.make_windows(tokens, 4, 512, tok.bos_token_id)
    todo = [schemes.get_scheme("fp16")]
    for spec in sys.argv[2:]:
        base, R, B = spec.split(":")
        todo.append(probe_scheme(base, int(R), int(B)))
    tic = time.time()
    results = ev.evaluate_tokens(model, windows, todo, 128)
    for r in results:
        print(
            r["kv"],
            f"{r['delta_ppl_pct']:+.2f}%",
            f"{r['kld']:.4f}",
            f"{r['top1']:.1f}",
        )
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(time.time() - tic)


if __name__ == "__main__":
    main()
