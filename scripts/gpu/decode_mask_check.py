"""Batched decode with left padding on the GPU machine: a ``BatchKVStore`` of
``Affine(8)`` keys and ``Affine(4)`` values (group 64) at one layer of a
Llama-3-8B shape (32 q / 8 kv heads, D=128), its decode step through the
affine decode kernel with the batch's boolean mask and through
``omlx_cache.kv.kernels.disabled()`` (the MLX-ops loop), each against float32
attention over what the store holds (correctness); and the kernel's time with
and without the mask against fp16 SDPA with the same mask over the
dequantized keys and values (speed).

    python3 scripts/gpu/decode_mask_check.py --batch 8 --contexts 4096,32768 --out $OUT/mask.json

``--dry-run`` runs the same code on the CPU at small shapes, through the
MLX-ops loop (no kernel applies there): it checks the script, not the kernel.
"""

import argparse
import json
from functools import partial

import mlx.core as mx
from kv_check import add_dry_run, compare, fill, ms_per_call, start, stored

from omlx_cache import kernels as backend
from omlx_cache.kv import Affine, BatchKVStore
from omlx_cache.kv.attention import Call


def filled_store(context, batch, padding, n_kv, D):
    """One layer's batch store holding ``context`` rows, sequence ``i`` from
    row ``padding[i]`` on (its left padding), the last token written as a
    decode step writes it."""
    store = BatchKVStore(padding, Affine(8, 64), Affine(4, 64))
    chunk = min(4096, context)
    k = mx.random.normal((batch, n_kv, chunk, D)).astype(mx.float16)
    v = mx.random.normal((batch, n_kv, chunk, D)).astype(mx.float16)
    for start_ in range(0, context - 1, chunk):
        n = min(chunk, context - 1 - start_)
        fill(store, k[:, :, :n], v[:, :, :n])
    return store


def check(context, batch, padding_step, n_q, n_kv, D):
    padding = [min(padding_step * i, context - 2) for i in range(batch)]
    store = filled_store(context, batch, padding, n_kv, D)
    mask = store.make_mask(1)
    token = mx.random.normal((batch, n_kv, 1, D)).astype(mx.float16)
    store.update_and_fetch(token, token)
    q = mx.random.normal((batch, n_q, 1, D)).astype(mx.float16)
    scale = D**-0.5
    call = Call(
        q,
        scale,
        mask,
        None,
        store.key_codec,
        store.value_codec,
        store.key_pages,
        store.value_pages,
        store._written - store.dropped,
        recent=store.spans.recent_tokens(),
    )
    row = {
        "context": context,
        "batch": batch,
        "kernel_applies": backend._decode_applies(call),
        "held": store.spans.n_held,
    }
    row.update(compare(store, q, scale, mask))
    keys, values = (x.astype(mx.float16) for x in stored(store))
    mx.eval(keys, values, mask)
    sdpa = partial(mx.fast.scaled_dot_product_attention, q, keys, values, scale=scale)
    attend = partial(store.scaled_dot_product_attention, q, None, None, scale)
    row["fp16_sdpa_masked_ms"] = ms_per_call(partial(sdpa, mask=mask), reps=7)
    row["kernel_masked_ms"] = ms_per_call(partial(attend, mask), reps=7)
    row["kernel_unmasked_ms"] = ms_per_call(partial(attend, None), reps=7)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--padding-step", type=int, default=37, help="keys per row")
    parser.add_argument("--out", required=True)
    add_dry_run(parser)
    opts = parser.parse_args()
    report = start(opts)
    shape = (8, 2, 64) if opts.dry_run else (32, 8, 128)
    contexts = [300] if opts.dry_run else [int(c) for c in opts.contexts.split(",")]
    batch = min(opts.batch, 3) if opts.dry_run else opts.batch
    rows = report["rows"] = []
    for context in contexts:
        rows.append(check(context, batch, opts.padding_step, *shape))
        print(json.dumps(rows[-1]), flush=True)
        mx.clear_cache()
    with open(opts.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
