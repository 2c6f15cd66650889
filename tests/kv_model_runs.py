"""Runs of real models through ``omlx_cache.kv`` stores for the tests.

- ``record_prefill``: one prefill through the model's own caches, recording
  each layer's keys, values and queries (for replaying into stores).
- ``chunk_runs``: a prompt prefilled through a scheme's stores in one chunk
  and in the other ways of ``ways`` (split where the first tokens end, a
  prefix continued by the last token; token by token, split inside the
  first tokens), then greedy tokens: per scheme and way, the greedy tokens
  and how far the logits are from one chunk's (after the prompt and at each
  greedy step) and from the model's own caches'. Run as a script, it prints
  them as JSON:

      python tests/kv_model_runs.py MODEL_DIR SCHEME... > runs.json

  (the tests run it in a process of its own without LD_PRELOAD: MLX's
  bundled reference BLAS computes each row of a product alike whatever the
  rows with it, so the ways that should give equal logits give equal ones;
  Debian's OpenBLAS, 2-3x faster, rounds a few rows differently).
"""

import json
import sys

import mlx.core as mx
from mlx_lm.models.cache import KVCache

PROMPT = (
    "Paris is the capital of France. Berlin is the capital of Germany. Rome "
    "is the capital of Italy. Madrid is the capital of Spain. Lisbon is the "
    "capital of"
)
# where a scheme without first tokens is split; a split inside the first
# tokens (besides one just before their end)
AFTER = 20
INSIDE = 3
GREEDY = 2


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


def ways(first, T):
    """How to prefill ``T`` tokens (each way: its chunks' ends) through a
    scheme of ``first`` first tokens: the ``equal`` ways (one chunk; split
    where the first tokens end, or at ``AFTER`` without any; the prompt but
    its last token, then that token) and the ``near`` ones (token by token;
    split inside the first tokens, and just before their end)."""
    equal = {"one": [T], "split": [first or AFTER, T], "prefix": [T - 1, T]}
    near = {"tokens": list(range(1, T + 1))}
    if first > INSIDE + 1:
        near["inside"] = [INSIDE, T]
    if first > 1:
        near["before_first"] = [first - 1, T]
    return equal, near


def _logits(model, hidden):
    """The last position's logits (the model's head on one row only)."""
    last = hidden[:, -1:]
    if getattr(model.args, "tie_word_embeddings", True):
        return model.model.embed_tokens.as_linear(last)[:, 0]
    return model.lm_head(last)[:, 0]


def _run(model, spec, tokens, cuts):
    """The last logits after each of ``cuts`` and then of each greedy step
    (a list), and the greedy tokens."""
    caches = spec.make_cache(model)
    start, hidden = 0, None
    for stop in cuts:
        hidden = model.model(tokens[:, start:stop], cache=caches)
        start = stop
    logits = [_logits(model, hidden)]
    greedy = []
    for _ in range(GREEDY):
        token = logits[-1].argmax(axis=-1)
        greedy.append(token.item())
        logits.append(_logits(model, model.model(token[None], cache=caches)))
    mx.eval(logits)
    return logits, greedy


def _relative(a, b):
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def _kl(p_logits, q_logits):
    """KL(p || q) of the softmaxes of two logit rows, in nats."""
    log_p = p_logits - mx.logsumexp(p_logits, axis=-1, keepdims=True)
    log_q = q_logits - mx.logsumexp(q_logits, axis=-1, keepdims=True)
    return (mx.exp(log_p) * (log_p - log_q)).sum().item()


def chunk_runs(model_dir, schemes, prompt=PROMPT):
    """Per scheme: its first tokens and, per way of prefilling (``ways``):
    the greedy tokens; the largest absolute difference from one chunk's
    logits after the prompt (``max_abs``) and at the greedy steps
    (``decode_max_abs``: None where the greedy tokens differ); the relative
    L2 distance of the logits after the prompt from one chunk's and from
    the model's own caches'; and KL(fp16 || way)."""
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    ids = tokenizer.encode(prompt)
    tokens = mx.array([ids])
    T = len(ids)
    (fp16, *_), fp16_greedy = _run(model, spec_of("fp16"), tokens, [T])
    top2 = mx.sort(fp16[0])[-2:]
    out = {
        "tokens": T,
        "fp16": {"greedy": fp16_greedy, "margin": (top2[1] - top2[0]).item()},
    }
    for text in schemes:
        spec = spec_of(text)
        equal, near = ways(spec.first_tokens, T)
        runs = {
            way: _run(model, spec, tokens, cuts)
            for way, cuts in {**equal, **near}.items()
        }
        (one, *one_steps), one_greedy = runs["one"]
        result = {"first": spec.first_tokens, "equal": list(equal), "near": list(near)}
        for way, ((logits, *steps), greedy) in runs.items():
            decode = None
            if greedy == one_greedy:
                decode = max(
                    mx.abs(a - b).max().item() for a, b in zip(steps, one_steps)
                )
            result[way] = {
                "greedy": greedy,
                "max_abs": mx.abs(logits - one).max().item(),
                "decode_max_abs": decode,
                "vs_one": _relative(logits, one),
                "vs_fp16": _relative(logits, fp16),
                "kl": _kl(fp16, logits),
            }
        out[text] = result
    return out


if __name__ == "__main__":
    print(json.dumps(chunk_runs(sys.argv[1], sys.argv[2:])))
