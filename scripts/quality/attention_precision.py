"""Precision of attention over a quantized cache in float16 and bfloat16.

One layer's attention, 32 q / 8 kv heads, D=128, 2,000 keys of which two
channels are outliers, the keys and values quantized (8 bits, group 64 by
default); decode (one query) and prefill (every key's query, causal). Each
row gives relative L2 errors of:

- ``ours``: ``base.quantized_scaled_dot_product_attention`` over the quantized
  keys and values (the MLX-ops path, or a CUDA kernel where one applies);
- ``sdpa``: ``mx.fast.scaled_dot_product_attention`` in the activation dtype
  over the keys and values as ``mx.dequantize`` returns them;
- ``quantization``: float32 attention over the unquantized keys and values,

each against two float32 references: attention over the cache's exact content
(``scale * q + bias`` in float32: ``*_vs_exact``), and over the keys and values
``mx.dequantize`` returns in the activation dtype, which rounds that content
(``*_vs_rounded``; the reference of issue 16's first table).

    python3 scripts/quality/attention_precision.py --out docs/data/attention-precision-cpu.json
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16}


def make_inputs(
    n_q_heads, n_kv_heads, head_dim, n_keys, n_queries, outlier, dtype, seed
):
    """Queries, keys and values in ``dtype``; key channels 5 and 77 (mod the
    head dim) carry offsets of +outlier and -0.75 outlier."""
    keys = mx.random.normal((1, n_kv_heads, n_keys, head_dim), key=mx.random.key(seed))
    channel = mx.arange(head_dim)
    offset = mx.where(channel == 5 % head_dim, outlier, 0.0)
    offset = offset + mx.where(channel == 77 % head_dim, -0.75 * outlier, 0.0)
    keys = keys + offset
    values = mx.random.normal(keys.shape, key=mx.random.key(seed + 1))
    shape = (1, n_q_heads, n_queries, head_dim)
    queries = mx.random.normal(shape, key=mx.random.key(seed + 2))
    return tuple(x.astype(dtype) for x in (queries, keys, values))


def float32_attention(queries, keys, values, scale, mask):
    f32 = [x.astype(mx.float32) for x in (queries, keys, values)]
    return mx.fast.scaled_dot_product_attention(*f32, scale=scale, mask=mask)


def dequantize(quantized, group_size, bits, dtype=None):
    """The quantized tensor's values, in float32 when ``dtype`` is float32
    (its exact content), else as ``mx.dequantize`` returns them."""
    packed, scales, biases = quantized
    if dtype is not None:
        scales, biases = scales.astype(dtype), biases.astype(dtype)
    return mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits)


def relative_error(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def measure(
    dtype,
    n_queries,
    n_q_heads=32,
    n_kv_heads=8,
    head_dim=128,
    n_keys=2000,
    bits=8,
    group_size=64,
    outlier=20.0,
    seed=0,
    repeats=3,
):
    """One row: the three errors against both references, and our call's
    median time over ``repeats`` calls after a first one."""
    queries, keys, values = make_inputs(
        n_q_heads, n_kv_heads, head_dim, n_keys, n_queries, outlier, dtype, seed
    )
    scale = head_dim**-0.5
    mask = "causal" if n_queries > 1 else None
    q_keys = tuple(mx.quantize(keys, group_size=group_size, bits=bits))
    q_values = tuple(mx.quantize(values, group_size=group_size, bits=bits))
    exact = [dequantize(x, group_size, bits, mx.float32) for x in (q_keys, q_values)]
    rounded = [dequantize(x, group_size, bits) for x in (q_keys, q_values)]
    references = {
        "exact": float32_attention(queries, *exact, scale, mask),
        "rounded": float32_attention(queries, *rounded, scale, mask),
    }
    mx.eval(queries, q_keys, q_values, references)
    times = []
    for _ in range(1 + repeats):
        start = time.perf_counter()
        ours = quantized_scaled_dot_product_attention(
            queries, q_keys, q_values, scale, mask, group_size=group_size, bits=bits
        )
        mx.eval(ours)
        times.append(time.perf_counter() - start)
    outputs = {
        "ours": ours,
        "sdpa": mx.fast.scaled_dot_product_attention(
            queries, *rounded, scale=scale, mask=mask
        ),
        "quantization": float32_attention(queries, keys, values, scale, mask),
    }
    row = {
        "dtype": str(dtype).split(".")[-1],
        "mode": "decode" if n_queries == 1 else "prefill",
        "queries": n_queries,
        "keys": n_keys,
        "heads": [n_q_heads, n_kv_heads],
        "head_dim": head_dim,
        "bits": bits,
        "group_size": group_size,
        "outlier": outlier,
        "ours_ms": 1e3 * statistics.median(times[1:]),
    }
    for name, out in outputs.items():
        assert out.dtype == (mx.float32 if name == "quantization" else dtype), name
        for ref_name, ref in references.items():
            row[f"{name}_vs_{ref_name}"] = relative_error(out, ref)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=2000)
    parser.add_argument(
        "--prefill-queries", type=int, default=512, help="the last positions"
    )
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--outlier", type=float, default=20.0)
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls")
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    rows = []
    for name in opts.dtypes.split(","):
        if name not in DTYPES:
            parser.error(f"unknown dtype {name!r}: choose from {', '.join(DTYPES)}")
        for n_queries in (1, opts.prefill_queries):
            row = measure(
                DTYPES[name],
                n_queries,
                n_keys=opts.keys,
                bits=opts.bits,
                group_size=opts.group_size,
                outlier=opts.outlier,
                repeats=opts.repeats,
            )
            rows.append(row)
            print(
                f"{row['dtype']:<8} {row['mode']:<7} ours {row['ours_vs_exact']:.2e} / "
                f"{row['ours_vs_rounded']:.2e}, sdpa {row['sdpa_vs_exact']:.2e} / "
                f"{row['sdpa_vs_rounded']:.2e}, quantization "
                f"{row['quantization_vs_exact']:.2e} / "
                f"{row['quantization_vs_rounded']:.2e} (vs exact / rounded); "
                f"ours {row['ours_ms']:.1f} ms",
                flush=True,
            )
    report = {"device": str(mx.default_device()), "mlx": mx.__version__, "rows": rows}
    with open(opts.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
