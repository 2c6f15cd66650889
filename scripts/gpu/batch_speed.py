"""Batched prefill and decode through mlx-lm's ``BatchGenerator`` (GPU machine).

What the server runs for concurrent requests: ``n`` random prompts of
``length`` tokens prefilled together in 2,048-token steps (masked, padded as
the server pads), then decoded together, with random 4-bit weights at a bench
preset's shape. Per batch and KV scheme, side by side in one process: the
time to every prompt's first token, decode tokens/s of the whole batch, a
decode step's median and 90th-percentile time (a few slow steps, fp16's too,
move the mean from run to run) and the peak memory over the weights. Each
batch runs twice (its first call, which compiles kernels for its shapes, is
kept apart): the rows are warm. Schemes: ``fp16`` (mlx-lm's own caches) or
any ``omlx_cache.kv.spec`` scheme; ``--jitter J`` makes prompt ``i`` ``i * J``
tokens shorter, so the batch is padded.

    python3 scripts/gpu/batch_speed.py --batches 1x32768,8x8192,4x32768 \\
        --schemes fp16 4 8,4 --out $OUT/batch-speed.json
"""

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from omlx_cache import bench
from omlx_cache.kv.spec import KVSpec


def batch(text: str) -> tuple[int, int]:
    n, length = text.split("x")
    return int(n), int(length)


def run(model, scheme, n, length, tokens, jitter, weights):
    vocab = model.args.vocab_size
    prompts = [
        bench.random_tokens(length - i * jitter, vocab, seed=i)[:, 0].tolist()
        for i in range(n)
    ]
    caches = None
    if scheme != "fp16":
        spec = KVSpec.parse(scheme)
        caches = [spec.make_cache(model) for _ in prompts]
    gen = BatchGenerator(
        model, max_tokens=tokens, completion_batch_size=n, prefill_batch_size=n
    )
    mx.clear_cache()
    mx.reset_peak_memory()
    start = time.perf_counter()
    gen.insert(prompts, caches=caches)
    first = last = None
    generated, steps = 0, []
    while responses := gen.next_generated():
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            steps.append(now - last)
        last = now
        generated += len(responses)
    end = time.perf_counter()
    gen.close()
    steps = sorted(steps) or [0.0]
    return {
        "batch": f"{n}x{length}",
        "scheme": scheme,
        "prompt_tokens": sum(len(p) for p in prompts),
        "prefill_s": first - start,
        "decode_tok_s": (generated - n) / (end - first),
        "step_ms_median": 1e3 * steps[len(steps) // 2],
        "step_ms_p90": 1e3 * steps[int(0.9 * len(steps))],
        "peak_over_weights_gib": (mx.get_peak_memory() - weights) / 2**30,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(bench.PRESETS))
    parser.add_argument(
        "--batches",
        default="1x8192,8x8192",
        type=lambda text: [batch(b) for b in text.split(",")],
        help="N x LENGTH, comma-separated (a 1 x LENGTH batch first: the others' pace)",
    )
    parser.add_argument("--schemes", nargs="+", default=["fp16", "4", "8,4"])
    parser.add_argument(
        "--tokens", type=int, default=64, help="decode tokens a sequence"
    )
    parser.add_argument("--jitter", type=int, default=0)
    parser.add_argument(
        "--fp16-max-tokens",
        type=int,
        default=1 << 17,
        help="skip fp16 for batches of more prompt tokens (its masked attention "
        "materialises the scores: 4 x 32K ran out of memory on 141 GB)",
    )
    parser.add_argument("--warmup", default="2x2048", type=batch)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    for scheme in opts.schemes:
        if scheme != "fp16":
            KVSpec.parse(scheme)  # checked before the model is built
    preset = bench.PRESETS[opts.preset]
    dtype = getattr(mx, opts.dtype or preset.get("dtype", "float16"))
    model = bench.build_model(preset, dtype)
    mx.eval(model.parameters())
    weights = mx.get_active_memory()
    rows, cold = [], []
    for scheme in opts.schemes:
        # the first call compiles each scheme's kernels: the cold start
        start = time.perf_counter()
        run(model, scheme, *opts.warmup, 8, opts.jitter, weights)
        seconds = time.perf_counter() - start
        cold.append({"scheme": scheme, "s": seconds})
        print(f"cold start {scheme}: {cold[-1]['s']:.1f} s", flush=True)
    for n, length in opts.batches:
        fp16 = None
        for scheme in opts.schemes:
            if scheme == "fp16" and n * length > opts.fp16_max_tokens:
                continue
            # a batch's first call compiles kernels for its shapes (the masked
            # prefill's, the page count's, a held buffer's first flush after
            # 32 decode tokens): timed apart, so that schemes and batches are
            # compared warm
            first_call = run(model, scheme, n, length, 40, opts.jitter, weights)
            row = run(model, scheme, n, length, opts.tokens, opts.jitter, weights)
            row["first_call_prefill_s"] = first_call["prefill_s"]
            if scheme == "fp16":
                fp16 = row
            elif fp16:
                row["prefill_vs_fp16"] = row["prefill_s"] / fp16["prefill_s"]
                row["decode_vs_fp16"] = row["decode_tok_s"] / fp16["decode_tok_s"]
                row["step_median_vs_fp16"] = (
                    fp16["step_ms_median"] / row["step_ms_median"]
                )
            alone = next(
                (
                    r
                    for r in rows
                    if r["scheme"] == scheme and r["batch"] == f"1x{length}"
                ),
                None,
            )
            if alone and n > 1:
                row["prefill_vs_alone"] = row["prefill_s"] / alone["prefill_s"]
            rows.append(row)
            print(
                f"{row['batch']:>9} {scheme:<8} prefill {row['prefill_s']:7.2f} s"
                f"  decode {row['decode_tok_s']:7.1f} tok/s"
                f" (step median {row['step_ms_median']:.1f} ms)"
                f"  peak {row['peak_over_weights_gib']:6.2f} GiB"
                + "".join(
                    f"  {k} {row[k]:.2f}x"
                    for k in (
                        "prefill_vs_fp16",
                        "decode_vs_fp16",
                        "step_median_vs_fp16",
                        "prefill_vs_alone",
                    )
                    if k in row
                ),
                flush=True,
            )
            write(opts, cold, rows)  # each row as it comes: a cut run keeps them
    write(opts, cold, rows)


def write(opts, cold, rows):
    report = {"preset": opts.preset, "tokens": opts.tokens, "jitter": opts.jitter}
    report.update(device=mx.device_info(), cold_start=cold, rows=rows)
    with open(opts.out, "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
