"""Probe: where the first token of a codebook cache's passkey answers loses
its log-probability against fp16 KV (a recent window, keys, values, the
softmax's bias).

    python3 scripts/quality/recent_window_probe.py --model models/gemma-3-270m \\
        --dtype bfloat16 --context 8192 --keys 6 --probe 0:5:4 --probe 128:5:4 \\
        --probe 0:5:16d --kv cq4 --out $OUT/recent-window-gemma3.json

On Gemma a passkey answer that misses mostly misses at its first token: a bare
space before the digits turns into " the" (docs/quality-levers.md, sessions
23 and 24). Each prompt of ``omlx_cache.eval``'s passkey test is prefilled
once with the model's own caches (the reference) and once per ``--probe
R:K:V[:E][d]``: in every layer a codebook cache of K-bit keys and V-bit
values (16: unquantized) with cq4's settings (centered keys, key weights, the
first E tokens kept, 8 by default), the last R tokens attended as they came
and the rest as the cache decodes them; ``d`` takes half the variance of each
decoded key's score error, from its own error, off its score
(``score_bias``; the caches' ``+debias`` estimates it from the stored norm).
A probe, not a cache to use: it keeps a float copy of every token. Per probe
it reports how often the answer's first token stops (lost) or starts
(gained) being the greedy one against the reference, and the change of its
log-probability (mean, standard error, spread). ``--kv NAME`` adds a
scheme's own caches (cq4: how close the probe comes to it).
"""

import argparse
import json
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache

from omlx_cache import eval as kv_eval
from omlx_cache import schemes
from omlx_cache.codebook import CodebookKVCache


class RecentExact(KVCache):
    """A float cache whose attention reads all but its last ``recent``
    tokens as ``codebook``, a codebook cache fed the same tokens, decodes
    them."""

    def __init__(self, codebook: CodebookKVCache, recent: int, debias=False):
        super().__init__()
        self.codebook = codebook
        self.recent = recent
        self.debias = debias

    def update_and_fetch(self, keys, values):
        self.codebook.update_and_fetch(keys, values)
        return super().update_and_fetch(keys, values)

    def scaled_dot_product_attention(
        self, queries, keys, values, scale, mask, sinks=None
    ):
        # the first attention call sets the key weights, as in the cache
        self.codebook._flush_first_write(queries)
        decoded_keys, decoded_values = self.codebook.dequantize(queries.dtype)
        cut = max(self.offset - self.recent, 0)
        exact_keys = keys
        keys = mx.concatenate([decoded_keys[:, :, :cut], keys[:, :, cut:]], axis=2)
        values = mx.concatenate(
            [decoded_values[:, :, :cut], values[:, :, cut:]], axis=2
        )
        if self.debias:
            mask = score_bias(queries, exact_keys, decoded_keys, cut, scale, mask)
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )


def score_bias(queries, keys, decoded_keys, cut, scale, mask):
    """``mask`` as an additive one that also takes half the expected
    variance of each decoded key's score error off its score: a noisy score
    ``s + n`` weighs ``exp(s)`` times ``exp(var(n) / 2)`` on average, so
    quantized keys would gain weight over exact ones (the kept first tokens,
    the recent window). The variance is that of ``q . e`` for the key's own
    error ``e`` in a random direction: ``|q|^2 |e|^2 / D``."""
    L, S, D = queries.shape[2], keys.shape[2], keys.shape[-1]
    error = (decoded_keys[:, :, :cut] - keys[:, :, :cut]).astype(mx.float32)
    error = mx.pad((error * error).sum(axis=-1) / D, [(0, 0), (0, 0), (0, S - cut)])
    error = mx.repeat(error, queries.shape[1] // keys.shape[1], axis=1)
    q2 = (queries.astype(mx.float32) ** 2).sum(axis=-1)
    bias = -0.5 * scale**2 * q2[..., :, None] * error[..., None, :]
    if isinstance(mask, str):
        mask = create_causal_mask(L, S - L)
    if mask is not None:
        bias = (
            mx.where(mask, bias, -float("inf"))
            if mask.dtype == mx.bool_
            else bias + mask
        )
    return bias.astype(queries.dtype)


def parse_probe(spec: str) -> dict:
    debias = spec.endswith("d")
    parts = [int(x) for x in spec.removesuffix("d").split(":")]
    if len(parts) not in (3, 4):
        raise SystemExit(f"--probe takes R:K:V or R:K:V:E, got {spec!r}.")
    recent, key_bits, value_bits = parts[:3]
    return {
        "name": spec,
        "recent": recent,
        "key_bits": key_bits,
        "value_bits": value_bits,
        "keep_exact": parts[3] if len(parts) == 4 else 8,
        "debias": debias,
    }


def codec_of(bits: int):
    """Codebook bits, 16 for unquantized."""
    return "plain" if bits == 16 else bits


def probe_caches(model, probe: dict) -> list:
    if "scheme" in probe:
        return schemes.get_scheme(probe["scheme"]).make_cache(model)
    return [
        RecentExact(
            CodebookKVCache(
                codec_of(probe["key_bits"]),
                codec_of(probe["value_bits"]),
                center="k",
                keep_exact=probe["keep_exact"],
                key_scale="qk",
            ),
            probe["recent"],
            probe["debias"],
        )
        for _ in model.layers
    ]


def first_token(model, prompt, cache, chunk: int) -> dict:
    """The answer's first token: its log-probability and whether it is the
    greedy one."""
    logits = kv_eval.prefill(model, prompt.tokens, cache, chunk).astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits)
    target = prompt.answer[0]
    greedy = int(mx.argmax(logprobs).item())
    return {"logprob": logprobs[target].item(), "greedy": greedy == target}


def summarize(reference: list[dict], trials: list[dict]) -> dict:
    delta = np.array([t["logprob"] - r["logprob"] for r, t in zip(reference, trials)])
    pairs = list(zip(reference, trials))
    return {
        "greedy": sum(t["greedy"] for t in trials),
        "lost": sum(r["greedy"] and not t["greedy"] for r, t in pairs),
        "gained": sum(t["greedy"] and not r["greedy"] for r, t in pairs),
        "delta_mean": float(delta.mean()),
        "delta_se": float(delta.std(ddof=1) / np.sqrt(len(delta))),
        "delta_sd": float(delta.std(ddof=1)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", choices=sorted(kv_eval.DTYPES), default=None)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--depths", type=int, default=8)
    parser.add_argument("--keys", type=int, default=1, help="keys per depth")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe", action="append", default=[], help="R:K:V[:E]")
    parser.add_argument(
        "--kv", action="append", default=[], help="a scheme's own caches too"
    )
    parser.add_argument("--out", help="write the trials and summaries as JSON")
    args = parser.parse_args()

    probes = [parse_probe(p) for p in args.probe]
    probes += [{"name": name, "scheme": name} for name in args.kv]
    model, tokenizer = kv_eval.load_model(args.model)
    if args.dtype:
        model.set_dtype(kv_eval.DTYPES[args.dtype])
    prompts = kv_eval.passkey_prompts(
        tokenizer,
        args.context,
        kv_eval.passkey_depths(args.depths),
        args.keys,
        args.seed,
        tokenizer.bos_token_id,
    )
    start = time.perf_counter()
    reference, trials = [], {p["name"]: [] for p in probes}
    for i, prompt in enumerate(prompts):
        ref = first_token(model, prompt, make_prompt_cache(model), args.chunk)
        reference.append({"depth": prompt.depth, "key": prompt.key, **ref})
        cells = []
        for probe in probes:
            trial = first_token(model, prompt, probe_caches(model, probe), args.chunk)
            trials[probe["name"]].append(trial)
            cells.append(f"{probe['name']} {trial['logprob'] - ref['logprob']:+.3f}")
        print(
            f"{i + 1}/{len(prompts)} depth {prompt.depth:.2f}: reference "
            f"{ref['logprob']:.3f}{'' if ref['greedy'] else ' (not greedy)'}, "
            + ", ".join(cells),
            flush=True,
        )
    summaries = {name: summarize(reference, t) for name, t in trials.items()}
    print(f"\nreference: first token greedy in {sum(r['greedy'] for r in reference)}")
    print("| probe | greedy | lost / gained | Δ log-prob (± se) | spread |")
    print("|---|---|---|---|---|")
    for name, s in summaries.items():
        print(
            f"| {name} | {s['greedy']} | {s['lost']} / {s['gained']} | "
            f"{s['delta_mean']:+.3f} ± {s['delta_se']:.3f} | {s['delta_sd']:.3f} |"
        )
    if args.out:
        report = {
            "model": args.model,
            "dtype": args.dtype,
            "context": args.context,
            "chunk": args.chunk,
            "seed": args.seed,
            "machine": kv_eval.machine(),
            "seconds": time.perf_counter() - start,
            "probes": probes,
            "reference": reference,
            "trials": trials,
            "summaries": summaries,
        }
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
