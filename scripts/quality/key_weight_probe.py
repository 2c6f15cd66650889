"""Which per-channel key weights help a 3-bit codebook, on captured queries and keys.

    python scripts/quality/key_weight_probe.py --out docs/data/key-weight-probe-smollm2.json

Feeds ``--tokens`` tokens of the text (BOS, then from token ``--skip`` on: past what
``omlx_cache.eval`` scores) through the model in 128-token chunks with plain caches, keeping
every layer's queries and keys. For each layer and kv head, the keys are centered on the mean of
the first chunk (its first token left out, as ``CodebookKVCache(center="k")``), scaled by weights
``a`` made from the first chunk, stored as the 3-bit codebook stores them (Hadamard rotation,
Lloyd-Max levels, "dot" norm) and scaled back; the score error ``E[(q . e)^2] / E[(q . k)^2]``
is averaged over every head for the queries of two ranges of positions (keys from token 16 up to
the query range's end). Weights (geometric mean 1, within 1/16 to 16):

- ``none``: 1;
- ``qk``: ``(E[q^2] / E[k^2]) ** 1/4`` (``query_key_weights(mode="qk")``);
- ``qk-clip4``: the same within 1/4 to 4;
- ``q-P``: ``E[q^2] ** P`` (``mode="q"`` is ``q-0.2``).
"""

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from omlx_cache import eval as kv_eval
from omlx_cache.codebook import lloyd_max

CHUNK = 128


class Recording(KVCache):
    """A plain cache that also keeps the queries it is attended with."""

    def __init__(self):
        super().__init__()
        self.queries = []

    def scaled_dot_product_attention(
        self, queries, keys, values, scale, mask, sinks=None
    ):
        self.queries.append(np.array(queries.astype(mx.float32)))
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask
        )


def hadamard(n):
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def codebook(x, bits, rotation):
    """``x`` (T, D) as a ``bits``-bit codebook stores it ("dot" norm), decoded."""
    levels = np.array(lloyd_max(bits)[0])
    edges = (levels[1:] + levels[:-1]) / 2
    y = x @ rotation.T
    norm = np.linalg.norm(y, axis=1, keepdims=True) + 1e-30
    unit = y / norm
    dim = x.shape[1]
    code = levels[np.searchsorted(edges, unit * np.sqrt(dim))] / np.sqrt(dim)
    dot = (unit * code).sum(1, keepdims=True)
    return (code * norm / dot) @ rotation


def weights(kind, q_energy, k_energy):
    if kind == "none":
        a = np.ones_like(q_energy)
    elif kind.startswith("qk"):
        a = (q_energy / k_energy) ** 0.25
    else:
        a = q_energy ** float(kind.split("-")[1])
    a = a / np.exp(np.log(a).mean())
    a = np.clip(a, 1 / 16, 16)
    if kind == "qk-clip4":
        a = np.clip(a, 1 / 4, 4)
    return a


def score_error(q, k, kind, lo, hi, bits, rotation):
    """Mean over heads of the relative score error of the queries at ``lo:hi``."""
    errors = []
    n_kv = k.shape[0]
    group = q.shape[0] // n_kv
    for h in range(n_kv):
        keys = k[h].astype(np.float64)
        queries = q[h * group : (h + 1) * group].astype(np.float64)
        centered = keys - keys[1:CHUNK].mean(0)
        q_energy = (queries[:, :CHUNK].reshape(-1, keys.shape[1]) ** 2).mean(0) + 1e-9
        k_energy = (centered[1:CHUNK] ** 2).mean(0) + 1e-9
        a = weights(kind, q_energy, k_energy)
        decoded = codebook(centered * a, bits, rotation) / a
        later = queries[:, lo:hi].reshape(-1, keys.shape[1])[::4]
        ref = centered[16:hi]
        var = ((later @ ref.T) ** 2).mean()
        errors.append(((later @ (ref - decoded[16:hi]).T) ** 2).mean() / var)
    return float(np.mean(errors))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(kv_eval.DEFAULT_MODEL))
    parser.add_argument("--text", default=str(kv_eval.DEFAULT_TEXT))
    parser.add_argument("--skip", type=int, default=100_000)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--bits", type=int, default=3)
    parser.add_argument("--kinds", default="none,qk,qk-clip4,q-0.15,q-0.2,q-0.25,q-0.3")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    model, tokenizer = kv_eval.load_model(args.model)
    ids = kv_eval.encode(tokenizer, kv_eval.read_text(args.text))
    tokens = mx.array(
        [tokenizer.bos_token_id] + ids[args.skip : args.skip + args.tokens - 1]
    )
    caches = [Recording() for _ in model.layers]
    for start in range(0, tokens.size, CHUNK):
        model(tokens[None, start : start + CHUNK], cache=caches)
        mx.eval([c.keys for c in caches])
    ranges = [(CHUNK, 512), (args.tokens - 512, args.tokens)]
    report = {
        "model": args.model,
        "skip": args.skip,
        "tokens": args.tokens,
        "bits": args.bits,
        "ranges": ranges,
        "score_error": {},
    }
    for kind in args.kinds.split(","):
        row = []
        for lo, hi in ranges:
            errs = []
            for c in caches:
                k = np.array(c.keys[0, :, : c.offset].astype(mx.float32))
                q = np.concatenate(c.queries, axis=2)[0]
                errs.append(
                    score_error(q, k, kind, lo, hi, args.bits, hadamard(k.shape[-1]))
                )
            row.append(float(np.mean(errs)))
        report["score_error"][kind] = row
        print(
            f"{kind:10s} "
            + "  ".join(f"{lo}-{hi}: {e:.4f}" for (lo, hi), e in zip(ranges, row))
        )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
