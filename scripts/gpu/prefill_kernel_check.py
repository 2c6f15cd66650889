"""The affine CUDA prefill paths (``omlx_cache.kernels.affine_prefill``,
registered as ``affine-prefill``) through ``omlx_cache.kv`` stores on the GPU
machine: a prefill chunk of a ``KVStore`` of two ``Affine`` codecs through the
fused kernel (``quantized_prefill_attention``: no first or held tokens; made
to apply with ``DECODED_BYTES = 0``) and through the dequantized copy and SDPA
(``decoded_attention``, the default where a KV head's copy fits
``DECODED_BYTES``; first tokens kept too), each against float32 attention
over what the store holds and against ``omlx_cache.kv.kernels.disabled()``
(the MLX-ops loop, in half precision); one layer's time for a prefill chunk
against fp16 SDPA; the memory a 128K-token layer adds. One process; JSON out.

    python3 scripts/gpu/prefill_kernel_check.py --out $OUT/prefill.json \\
        [--parts correctness,ops,speed,memory] [--head-dims 64,128,256]

``--dry-run`` runs the same code on the CPU at small shapes, through the
MLX-ops loop (no kernel applies there): it checks the script, not the kernels.
"""

import argparse
import contextlib
import time
from functools import partial

import mlx.core as mx
from kv_check import (
    Report,
    add_dry_run,
    compare,
    fill,
    max_error,
    ms_per_call,
    noisy_tail,
    ops,
    reference,
    start,
    worst,
)

from omlx_cache import kernels as backend
from omlx_cache.kernels import affine_prefill
from omlx_cache.kv import Affine, KVStore

DTYPES = {"f16": mx.float16, "bf16": mx.bfloat16, "f32": mx.float32}

# D, n_q_heads, n_kv_heads, (key bits, group), (value bits, group), keys,
# queries (the last positions), batch, dtype, page size, first tokens kept
CASES = [
    (128, 32, 8, (8, 64), (4, 64), 2048, 2048, 1, "f16", 4096, 0),
    (128, 32, 8, (8, 64), (4, 64), 9000, 2048, 1, "f16", 4096, 0),
    (128, 32, 8, (4, 64), (4, 64), 5000, 300, 1, "bf16", 4096, 16),
    (128, 32, 8, (8, 64), (8, 64), 3000, 77, 2, "f16", 4000, 0),
    (128, 8, 8, (4, 32), (2, 32), 777, 777, 1, "f16", 1024, 0),
    (128, 64, 8, (8, 128), (4, 32), 4096, 1000, 1, "bf16", 4096, 8),
    (128, 32, 8, (8, 64), (4, 64), 1000, 16, 1, "f16", 4096, 0),
    (64, 9, 3, (8, 64), (4, 64), 300, 300, 1, "f16", 4096, 0),
    (64, 9, 3, (8, 32), (4, 32), 4097, 129, 2, "f16", 4096, 16),
    (64, 4, 1, (2, 32), (2, 32), 1000, 100, 1, "f16", 4096, 0),
    (64, 4, 2, (8, 64), (8, 64), 500, 50, 1, "f32", 4096, 0),
    (64, 4, 1, (4, 64), (4, 64), 20 * 256 - 5, 200, 1, "f16", 256, 0),
    (256, 16, 2, (8, 64), (4, 64), 2000, 500, 1, "bf16", 4096, 0),
    (256, 8, 4, (4, 128), (8, 128), 4097, 64, 1, "f16", 4096, 0),
]
DRY_CASES = [
    (64, 4, 2, (8, 64), (4, 64), 150, 40, 1, "f16", 64, 0),
    (64, 6, 2, (4, 32), (8, 64), 90, 20, 2, "f32", 32, 8),
]


@contextlib.contextmanager
def decoded_bytes(n):
    """``affine_prefill.DECODED_BYTES`` set to ``n`` within (0: the fused
    kernel wherever it applies)."""
    default = affine_prefill.DECODED_BYTES
    affine_prefill.DECODED_BYTES = n
    try:
        yield
    finally:
        affine_prefill.DECODED_BYTES = default


def prefilled(case, seed=0):
    """A store holding the case's keys but the last L, and those L keys and
    their queries: (store, keys, values, queries)."""
    D, n_q, n_kv, (kb, kg), (vb, vg), T, L, B, dtype, page, first = case
    dtype = DTYPES[dtype]
    keys = mx.random.normal((B, n_kv, T, D), key=mx.random.key(seed))
    keys = keys + 2 * mx.random.normal((1, n_kv, 1, D), key=mx.random.key(seed + 1))
    values = mx.random.normal((B, n_kv, T, D), key=mx.random.key(seed + 2))
    queries = mx.random.normal((B, n_q, L, D), key=mx.random.key(seed + 3))
    store = KVStore(Affine(kb, kg), Affine(vb, vg), first=first, page_size=page)
    keys, values = keys.astype(dtype), values.astype(dtype)
    fill(store, keys[:, :, : T - L], values[:, :, : T - L])
    return store, keys[:, :, T - L :], values[:, :, T - L :], queries.astype(dtype)


def case_row(case):
    D, n_q, n_kv, kbits, vbits, T, L, B, dtype, page, first = case
    return {
        "D": D,
        "heads": [n_q, n_kv],
        "bits": [kbits[0], vbits[0]],
        "group_size": [kbits[1], vbits[1]],
        "keys": T,
        "queries": L,
        "batch": B,
        "dtype": dtype,
        "page_size": page,
        "first": first,
    }


def path_of(store, queries):
    """The prefill path the registry takes for this store's next call."""
    from omlx_cache.kv.attention import Call

    call = Call(
        queries,
        1.0,
        "causal",
        None,
        store.key_codec,
        store.value_codec,
        store.key_pages,
        store.value_pages,
        store._written - store.dropped,
        first=store._first(queries),
    )
    path = backend._prefill_path(call)
    return None if path is None else path.__name__


def correctness(report, cases):
    for case in cases:
        for name, budget in (("decoded", affine_prefill.DECODED_BYTES), ("fused", 0)):
            store, keys, values, queries = prefilled(case)
            store.update_and_fetch(keys, values)
            noisy_tail(store)
            row = case_row(case) | {"path": name}
            with decoded_bytes(budget):
                row["applies"] = path_of(store, queries)
                row.update(compare(store, queries, case[0] ** -0.5, "causal"))
            report.add("correctness", row)
    rows = report["correctness"]
    for name in ("fused", "decoded"):
        taken = [r for r in rows if r["applies"] == _PATHS[name]]
        report[f"worst_{name}_rel_err"] = worst(taken, "kernel_rel_err")
    report["worst_ops_rel_err"] = worst(rows, "ops_rel_err")
    report.save()
    print(
        "worst relative error against float32:",
        {k: v for k, v in report.items() if k.startswith("worst")},
        flush=True,
    )


_PATHS = {
    "fused": "quantized_prefill_attention",
    "decoded": "decoded_attention",
}


def ops_check(report, case):
    """The MLX-ops loop on this device (float32 scores) in half precision
    against the reference and against the kernels, one case per dtype."""
    for dtype in ("f16", "bf16"):
        case = (*case[:8], dtype, *case[9:])
        store, keys, values, queries = prefilled(case, seed=7)
        store.update_and_fetch(keys, values)
        scale = case[0] ** -0.5
        row = case_row(case)
        try:
            ref = reference(store, queries, scale, "causal")
            loop = ops(store, queries, scale, "causal")
            row["rel_err"] = max_error(loop, ref)
            for name, budget in (
                ("decoded", affine_prefill.DECODED_BYTES),
                ("fused", 0),
            ):
                with decoded_bytes(budget):
                    out = store.scaled_dot_product_attention(
                        queries, None, None, scale, "causal"
                    )
                row[f"{name}_vs_ops"] = max_error(out, loop)
        except (RuntimeError, ValueError) as error:  # what this device cannot do
            row["error"] = str(error)[:300]
        report.add("ops", row)


def speed(report, contexts, head_dims, L):
    """One layer, 32 q / 8 kv heads: the last ``L`` positions of a context
    attend (causal) to all of it, as a prefill chunk does; fp16 SDPA, the
    fused kernel and the dequantized copy."""
    n_q, n_kv = 32, 8
    for D, T in ((D, T) for D in head_dims for T in contexts):
        q = mx.random.normal((1, n_q, L, D)).astype(mx.float16)
        k = mx.random.normal((1, n_kv, T, D)).astype(mx.float16)
        v = mx.random.normal((1, n_kv, T, D)).astype(mx.float16)
        mx.eval(q, k, v)
        row = {"context": T, "queries": L, "head_dim": D}
        sdpa = partial(
            mx.fast.scaled_dot_product_attention, q, k, v, scale=D**-0.5, mask="causal"
        )
        row["fp16_sdpa_ms"] = ms_per_call(sdpa, n=4, reps=5, warmup=2)
        for kb, vb in ((8, 4), (4, 4), (8, 8)):
            store = fill(KVStore(Affine(kb), Affine(vb), page_size=T), k, v)
            call = partial(
                store.scaled_dot_product_attention, q, None, None, D**-0.5, "causal"
            )
            with decoded_bytes(0):
                row[f"kernel_{kb},{vb}_ms"] = ms_per_call(call, n=4, reps=5, warmup=2)
            row[f"decoded_{kb},{vb}_ms"] = ms_per_call(call, n=4, reps=5, warmup=2)
        flops = 4 * n_q * D * L * (T - L / 2)
        row["fp16_sdpa_tflops"] = round(flops / row["fp16_sdpa_ms"] / 1e9, 1)
        row["kernel_8,4_tflops"] = round(flops / row["kernel_8,4_ms"] / 1e9, 1)
        report.add("speed", row)
        del q, k, v
        mx.clear_cache()


def memory(report, context, L):
    """One layer's prefill call at ``context`` keys (``L`` queries, 32 q / 8
    kv heads, D=128) through a store: the memory it adds while it runs and
    its time, for the fused kernel and for the dequantized copy under
    several ``DECODED_BYTES``."""
    n_q, n_kv, D = 32, 8, 128
    q = mx.random.normal((1, n_q, L, D)).astype(mx.float16)
    for kb, vb in ((4, 4), (8, 4)):
        k = mx.random.normal((1, n_kv, context, D)).astype(mx.float16)
        store = fill(KVStore(Affine(kb), Affine(vb), page_size=context), k, k)
        del k
        mx.eval(q)
        for budget in (0, 1 << 30, 1 << 28, 1 << 26):
            with decoded_bytes(budget):
                for _ in range(3):
                    mx.synchronize()
                    before = mx.get_active_memory()
                    mx.reset_peak_memory()
                    began = time.perf_counter()
                    out = store.scaled_dot_product_attention(
                        q, None, None, D**-0.5, "causal"
                    )
                    mx.eval(out)
                    ms = (time.perf_counter() - began) * 1e3
                    added = mx.get_peak_memory() - before
                    del out
            report.add(
                "memory",
                {
                    "bits": [kb, vb],
                    "context": context,
                    "path": "kernel" if budget == 0 else "decoded",
                    "decoded_bytes": budget,
                    "added_mib": added / 2**20,
                    "ms": round(ms, 2),
                },
            )
        del store
        mx.clear_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="prefill-kernel.json")
    parser.add_argument("--parts", default="correctness,ops,speed")
    parser.add_argument("--contexts", default="4096,32768,131072")
    parser.add_argument("--head-dims", default="128")
    add_dry_run(parser)
    args = parser.parse_args()
    report = Report(args.out, start(args))
    contexts = [int(c) for c in args.contexts.split(",")]
    head_dims = [int(d) for d in args.head_dims.split(",")]
    cases, L, context = CASES, 2048, 131072
    ops_case = (128, 32, 8, (8, 64), (4, 64), 1000, 64, 1, "f16", 4096, 0)
    if args.dry_run:
        cases, L, context, contexts, head_dims = DRY_CASES, 16, 512, [128], [64]
        ops_case = DRY_CASES[0]
    parts = {
        "correctness": partial(correctness, cases=cases),
        "ops": partial(ops_check, case=ops_case),
        "speed": partial(speed, contexts=contexts, head_dims=head_dims, L=L),
        "memory": partial(memory, context=context, L=L),
    }
    for name in args.parts.split(","):
        if name not in parts:
            parser.error(f"unknown part {name!r}: choose from {', '.join(parts)}")
        parts[name](report)


if __name__ == "__main__":
    main()
