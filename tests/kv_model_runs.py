"""Runs of real models through ``omlx_cache.kv`` stores for the tests.

- ``record_prefill``: one prefill through the model's own caches, recording
  each layer's keys, values and queries (for replaying into stores).
- ``chunk_runs``: a prompt prefilled in one chunk, in several and token by
  token through a scheme's stores, then greedy tokens: per scheme, how far
  each run's last logits are from one chunk's and from the model's own
  caches', and the greedy tokens. Run as a script, it prints them as JSON:

      python tests/kv_model_runs.py MODEL_DIR SCHEME... > runs.json

  (the tests run it in a process of its own, with Debian's OpenBLAS
  preloaded where it is installed: MLX's bundled reference BLAS makes a
  SmolLM2 prefill ten times slower).
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

PROMPT = (
    "Paris is the capital of France. Berlin is the capital of Germany. Rome "
    "is the capital of Italy. Madrid is the capital of Spain. Lisbon is the "
    "capital of"
)
# the several chunks' ends (the last: the prompt's end)
CUTS = (13, 30)
GREEDY = 2
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")


class Recording(KVCache):
    """The model's own cache, recording what each attention call gets."""

    def __init__(self):
        super().__init__()
        self.writes, self.queries, self.scale = [], [], None

    def update_and_fetch(self, keys, values):
        self.writes.append((keys, values))
        return super().update_and_fetch(keys, values)

    def scaled_dot_product_attention(
        self, queries, keys, values, scale, mask, sinks=None
    ):
        self.queries.append(queries)
        self.scale = scale
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )


def record_prefill(model, tokens):
    """Per layer: (keys, values, queries, scale) of a one-chunk prefill of
    ``tokens`` (a list of ids) through the model's own caches."""
    caches = [Recording() for _ in model.layers]
    mx.eval(model(mx.array([tokens]), cache=caches))
    return [(*c.writes[0], c.queries[0], c.scale) for c in caches]


def spec_of(text, layers=(0, 1)):
    """The spec of a scheme, a fitted one (``fit=``) given ``layers``."""
    from omlx_cache.kv.spec import KVSpec

    spec = KVSpec.parse(text)
    return spec.with_layers(layers) if spec.fit is not None else spec


def _logits(model, hidden):
    """The last position's logits (the model's head on one row only)."""
    last = hidden[:, -1:]
    if getattr(model.args, "tie_word_embeddings", True):
        return model.model.embed_tokens.as_linear(last)[:, 0]
    return model.lm_head(last)[:, 0]


def _run(model, spec, tokens, cuts):
    caches = spec.make_cache(model)
    start, hidden = 0, None
    for stop in cuts:
        hidden = model.model(tokens[:, start:stop], cache=caches)
        start = stop
    logits = first = _logits(model, hidden)
    greedy = []
    for _ in range(GREEDY):
        token = logits.argmax(axis=-1)
        greedy.append(token.item())
        logits = _logits(model, model.model(token[None], cache=caches))
    return first, greedy


def _relative(a, b):
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def _kl(p_logits, q_logits):
    """KL(p || q) of the softmaxes of two logit rows, in nats."""
    log_p = p_logits - mx.logsumexp(p_logits, axis=-1, keepdims=True)
    log_q = q_logits - mx.logsumexp(q_logits, axis=-1, keepdims=True)
    return (mx.exp(log_p) * (log_p - log_q)).sum().item()


def chunk_runs(model_dir, schemes, prompt=PROMPT):
    """Per scheme and way of prefilling ("one", "chunks", "tokens"): the
    greedy tokens, the last logits' relative L2 distance from one chunk's
    and from fp16's, and KL(fp16 || run)."""
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    ids = tokenizer.encode(prompt)
    tokens = mx.array([ids])
    T = len(ids)
    ways = {"one": [T], "chunks": [*CUTS, T], "tokens": list(range(1, T + 1))}
    fp16, fp16_greedy = _run(model, spec_of("fp16"), tokens, [T])
    top2 = mx.sort(fp16[0])[-2:]
    out = {
        "tokens": T,
        "fp16": {"greedy": fp16_greedy, "margin": (top2[1] - top2[0]).item()},
    }
    for text in schemes:
        spec = spec_of(text)
        runs = {way: _run(model, spec, tokens, cuts) for way, cuts in ways.items()}
        one = runs["one"][0]
        out[text] = {
            way: {
                "greedy": greedy,
                "vs_one": _relative(logits, one),
                "vs_fp16": _relative(logits, fp16),
                "kl": _kl(fp16, logits),
            }
            for way, (logits, greedy) in runs.items()
        }
    return out


if __name__ == "__main__":
    print(json.dumps(chunk_runs(sys.argv[1], sys.argv[2:])))
