"""Helpers of the kernel check scripts (``codebook_kernel_check``,
``decode_kernel_check``, ``prefill_kernel_check``, ``decode_mask_check``):
stores filled with random tokens, their attention through the kernels and
through ``omlx_cache.kv.kernels.disabled()`` (the MLX-ops loop, the
reference on every backend), a float32 reference over what a store holds,
timings and a JSON report written as rows come.

``--dry-run`` (every script): the default device is the CPU and the shapes
are small, so the same code runs through the MLX-ops loop (no kernel applies
off CUDA): a check that the script works, not of the kernels.
"""

import json
import time

import mlx.core as mx

from omlx_cache.kv import kernels
from omlx_cache.kv.rotation import rotate


def on_cuda() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def add_dry_run(parser):
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="on the CPU with small shapes, through the MLX-ops loop (no kernel "
        "applies there): checks the script, not the kernels",
    )


def start(opts) -> dict:
    """The report's head; on a dry run the CPU becomes the default device."""
    if opts.dry_run:
        mx.set_default_device(mx.cpu)
    elif not on_cuda():
        raise SystemExit("no CUDA device: the kernels do not run here (--dry-run?)")
    return {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "dry_run": opts.dry_run,
        "kernels": kernels.names(),
    }


class Report(dict):
    """A JSON report written to ``path`` whenever a row is added (a run cut
    short keeps its rows)."""

    def __init__(self, path, head):
        super().__init__(head)
        self.path = path

    def add(self, part, row):
        self.setdefault(part, []).append(row)
        print(json.dumps(row), flush=True)
        self.save()

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self, f, indent=1)


def fill(store, keys, values, chunk=4096, decode=0):
    """Write ``keys`` and ``values`` (B, heads, T, D) into ``store`` in chunks,
    the last ``decode`` tokens one at a time (on CUDA the decode kernels
    hold them unquantized)."""
    T = keys.shape[2]
    for start_ in range(0, T - decode, chunk):
        stop = min(start_ + chunk, T - decode)
        store.update_and_fetch(keys[:, :, start_:stop], values[:, :, start_:stop])
        mx.eval(store.key_pages, store.value_pages)
    for t in range(T - decode, T):
        store.update_and_fetch(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    return store


def noisy_tail(store, scale=50.0):
    """Loud noise, encoded, in the rows of the last page that hold no token:
    attention must not read them."""
    if not store.key_pages:
        return
    rows = (
        store._written
        - store.dropped
        - (store.capacity - store.key_pages[-1][0].shape[2])
    )
    for codec, pages in (
        (store.key_codec, store.key_pages),
        (store.value_codec, store.value_pages),
    ):
        page = pages[-1]
        size = page[0].shape[2]
        if rows >= size:
            continue
        B, heads = page[0].shape[:2]
        dim = codec.dim(page)
        # the model's dtype: a plain page's, affine scales'; codebook norms'
        dtype = page[0].dtype if len(page) == 1 else page[1].dtype
        dtype = mx.float16 if dtype == mx.uint8 else dtype
        noise = scale * mx.random.normal((B, heads, size - rows, dim)).astype(dtype)
        for dst, src in zip(page, codec.encode(noise)):
            dst[:, :, rows:] = src
    mx.eval(store.key_pages, store.value_pages)


def stored(store):
    """The keys and values a store's attention reads, in float32, as the
    model gave them: a sequence's first tokens the pages do not hold (a
    KVStore's pages begin after them) as kept, the pages decoded (a batch's
    first tokens as kept), the held tokens as held, rotated back, unweighted
    and uncentered."""
    kc, vc = store.key_codec, store.value_codec
    spans = store.spans
    store._flush_pending()
    spans.land(store._prepare_held)
    length = store._written - store.dropped
    parts = []
    for codec, pages, held, first in (
        (kc, store.key_pages, spans.held_keys, spans.first_keys),
        (vc, store.value_pages, spans.held_values, spans.first_values),
    ):
        decoded = [codec.decode(page, mx.float32) for page in pages]
        if decoded:
            parts.append(mx.concatenate(decoded, axis=2)[:, :, :length])
        else:  # no page rows: every token held, or in the first span
            like = held if held is not None else first
            parts.append(like[:, :, :0].astype(mx.float32))
    keys, values = parts
    if spans.first_keys is not None and store._is_batch():
        # each sequence's first tokens at rows left_padding[i] on
        for i, pad in enumerate(store.left_padding_array().tolist()):
            lo = pad - store.dropped
            n = min(spans.first, length - lo)
            if lo >= 0 and n > 0:
                keys[i, :, lo : lo + n] = spans.first_keys[i, :, :n]
                values[i, :, lo : lo + n] = spans.first_values[i, :, :n]
    elif spans.first_keys is not None:
        # (any batch size) rows 0 to first - 1, in the first span only
        n = min(spans.first, store.dropped)
        keys, values = (
            mx.concatenate([x[:, :, :n].astype(mx.float32), y], axis=2)
            for x, y in ((spans.first_keys, keys), (spans.first_values, values))
        )
    if spans.n_held:
        held = [
            x[:, :, : spans.n_held].astype(mx.float32)
            for x in (spans.held_keys, spans.held_values)
        ]
        if not spans.rotated:
            held = [rotate(held[0], kc.rotation), rotate(held[1], vc.rotation)]
        keys = mx.concatenate([keys, held[0]], axis=2)
        values = mx.concatenate([values, held[1]], axis=2)
    keys = rotate(keys, kc.rotation, inverse=True)
    values = rotate(values, vc.rotation, inverse=True)
    return store.transform.undo(keys, values)


def float_attention(queries, keys, values, scale, mask=None, sinks=None):
    """float32 attention by explicit ops, query heads folded onto their KV
    head (on CUDA float32 matmuls may round in TF32: MLX_ENABLE_TF32=0);
    ``sinks`` (n_q_heads,): a logit per query head of a key with no value."""
    B, n_q, L, D = queries.shape
    n_kv = keys.shape[1]
    q = queries.astype(mx.float32).reshape(B, n_kv, n_q // n_kv, L, D)
    keys, values = keys.astype(mx.float32), values.astype(mx.float32)
    scores = (q * scale) @ keys[:, :, None].swapaxes(-1, -2)
    S = keys.shape[2]
    if isinstance(mask, str):
        causal = mx.arange(S)[None] <= (mx.arange(L)[:, None] + S - L)
        scores = mx.where(causal, scores, -float("inf"))
    elif mask is not None:
        while mask.ndim < 4:
            mask = mask[None]
        if mask.shape[1] not in (1, n_kv):  # per query head
            mask = mask.reshape(mask.shape[0], n_kv, n_q // n_kv, *mask.shape[2:])
        else:
            mask = mask[:, :, None]
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, -float("inf"))
        else:
            scores = scores + mask.astype(mx.float32)
    if sinks is not None:
        sink = sinks.astype(mx.float32).reshape(1, n_kv, n_q // n_kv, 1, 1)
        scores = mx.concatenate(
            [scores, mx.broadcast_to(sink, (*scores.shape[:-1], 1))], axis=-1
        )
    probs = mx.softmax(scores, axis=-1)[..., :S]
    out = probs @ values[:, :, None]
    return out.reshape(B, n_q, L, -1)


def reference(store, queries, scale, mask=None, sinks=None):
    """float32 attention over what the store holds (``stored``)."""
    return float_attention(queries, *stored(store), scale, mask, sinks)


def attend(store, queries, scale, mask=None, sinks=None):
    """The store's attention: the kernels where they apply."""
    return store.scaled_dot_product_attention(
        queries, None, None, scale, mask, sinks=sinks
    )


def ops(store, queries, scale, mask=None, sinks=None):
    """The store's attention through the MLX-ops loop."""
    with kernels.disabled():
        return attend(store, queries, scale, mask, sinks)


def max_error(a, b) -> float:
    """Largest absolute difference over the largest magnitude of ``b``."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


def l2_error(a, b) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def compare(store, queries, scale, mask=None, sinks=None):
    """The kernels' output (first: a decode kernel may write the incoming
    held token), the ops loop's and the float32 reference's errors."""
    out = attend(store, queries, scale, mask, sinks)
    mx.eval(out)
    ref = reference(store, queries, scale, mask, sinks)
    loop = ops(store, queries, scale, mask, sinks)
    return {
        "kernel_rel_err": max_error(out, ref),
        "ops_rel_err": max_error(loop, ref),
        "kernel_vs_ops": max_error(out, loop),
        "dtype_ok": out.dtype == queries.dtype,
    }


def ms_per_call(fn, n=16, reps=5, warmup=3):
    """Best of ``reps`` batches of ``n`` calls, ms per call."""
    for _ in range(warmup):
        mx.eval(fn())
    best = float("inf")
    for _ in range(reps):
        start_ = time.perf_counter()
        mx.eval([fn() for _ in range(n)])
        best = min(best, (time.perf_counter() - start_) / n)
    return round(best * 1e3, 4)


def worst(rows, key):
    values = [r[key] for r in rows if r.get(key) is not None]
    return max(values) if values else None
