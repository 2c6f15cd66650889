"""What one graph node costs the host in a decode step (GPU machine).

Each case builds 32 "layers" of one kind of node per step, as a decode step
of a 32-layer model does, and times over the steps (median): building the
graph in Python and building plus evaluating it. Divided by the 32 layers
this is the host's cost of that node, the number to set against the device
time of a step. Cases: an elementwise add, a one-token slice update of an
fp16 cache, ``mx.quantize`` of one token, a trivial ``mx.fast.cuda_kernel``
with 1, 6 and 98 inputs (98: a 16-page launch of the decode kernel), the
same kernel filling its outputs (``init_value``), fp16 SDPA over the
context, and the quantized decode attention (kernel plus combine) over one
page and over 4,096-token pages.

    python3 scripts/gpu/decode_host_cost.py --context 32768 --out $OUT/host-cost.json
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.models import quantized_decode

LAYERS, N_Q, N_KV, D = 32, 32, 8, 128

_TRIVIAL = """
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < x_shape[3]) {
        out[i] = x[i] + static_cast<T>(1);
    }
"""
_trivial_kernels = {}


def trivial_kernel(n_inputs):
    if n_inputs not in _trivial_kernels:
        names = ["x"] + [f"extra_{i}" for i in range(n_inputs - 1)]
        _trivial_kernels[n_inputs] = mx.fast.cuda_kernel(
            name=f"host_cost_trivial_{n_inputs}",
            input_names=names,
            output_names=["out"],
            source=_TRIVIAL,
        )
    return _trivial_kernels[n_inputs]


def time_steps(build, steps, warmup=3):
    """Median ms per step to build the graph, and to build and evaluate it."""
    built, total = [], []
    for s in range(steps + warmup):
        start = time.perf_counter()
        outs = build()
        middle = time.perf_counter()
        mx.eval(outs)
        end = time.perf_counter()
        if s >= warmup:
            built.append(middle - start)
            total.append(end - start)
    return 1e3 * statistics.median(built), 1e3 * statistics.median(total)


def cases(context):
    token = mx.random.normal((1, N_KV, 1, D)).astype(mx.float16)
    query = mx.random.normal((1, N_Q, 1, D)).astype(mx.float16)
    extras = [mx.zeros((4,), dtype=mx.float16) for _ in range(97)]
    caches = [mx.zeros((1, N_KV, context, D), dtype=mx.float16) for _ in range(LAYERS)]
    keys = [mx.random.normal((1, N_KV, context, D)).astype(mx.float16)] * 2
    mx.eval(token, query, extras, caches, keys)
    position = [0]

    def add():
        return [token + i for i in range(LAYERS)]

    def slice_update():
        p = position[0] = (position[0] + 1) % context
        for c in caches:
            c[..., p : p + 1, :] = token
        return caches

    def quantize():
        return [mx.quantize(token + i, group_size=64, bits=8) for i in range(LAYERS)]

    def kernel(n_inputs, init_value=None):
        def build():
            x = token
            for _ in range(LAYERS):
                x = trivial_kernel(n_inputs)(
                    inputs=[x] + extras[: n_inputs - 1],
                    template=[("T", mx.float16)],
                    grid=(D, 1, 1),
                    threadgroup=(D, 1, 1),
                    output_shapes=[x.shape],
                    output_dtypes=[x.dtype],
                    init_value=init_value,
                )[0]
            return x

        return build

    def sdpa():
        return [
            mx.fast.scaled_dot_product_attention(
                query + i, keys[0], keys[1], scale=D**-0.5, mask=None
            )
            for i in range(LAYERS)
        ]

    def quantized(page_size):
        pages = []
        for start in range(0, context, page_size):
            n = min(page_size, context - start)
            k = tuple(mx.quantize(keys[0][..., :n, :], group_size=64, bits=8))
            v = tuple(mx.quantize(keys[1][..., :n, :], group_size=64, bits=4))
            pages.append((k, v))
        mx.eval(pages)
        key_pages = [p[0] for p in pages]
        value_pages = [p[1] for p in pages]

        def build():
            return [
                quantized_decode.quantized_decode_attention(
                    query + i, key_pages, value_pages, D**-0.5, context, 64, 8, 64, 4
                )
                for i in range(LAYERS)
            ]

        return build

    portable = {"add": add, "slice_update": slice_update, "quantize": quantize}
    if not mx.cuda.is_available():
        return portable
    return {
        **portable,
        "kernel_1_input": kernel(1),
        "kernel_6_inputs": kernel(6),
        "kernel_98_inputs": kernel(98),
        "kernel_1_input_init_value": kernel(1, 0.0),
        "sdpa_fp16": sdpa,
        "quantized_decode_1_page": quantized(context),
        "quantized_decode_4096_pages": quantized(4096),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    rows = []
    print(f"{'case':<30} {'build us/layer':>15} {'total us/layer':>15}")
    for name, build in cases(opts.context).items():
        built, total = time_steps(build, opts.steps)
        row = {
            "case": name,
            "build_us_per_layer": 1e3 * built / LAYERS,
            "total_us_per_layer": 1e3 * total / LAYERS,
        }
        rows.append(row)
        print(
            f"{name:<30} {row['build_us_per_layer']:>15.1f} "
            f"{row['total_us_per_layer']:>15.1f}",
            flush=True,
        )
    info = {"device": str(mx.default_device()), "context": opts.context}
    with open(opts.out, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
