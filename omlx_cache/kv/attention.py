"""One attention driver for every store: kernels first, else a tiled loop.

``attend(call)`` tries the kernels registered in ``kernels`` and otherwise
runs the MLX-ops loop, the reference on every backend: the stored keys are
read one tile at a time (so the workspace does not grow with the context),
scored against the queries and weighed into the output with an online
softmax (running maximum and sum) in float32, whatever the activations'
type. Query heads that share a KV head are folded into the query axis (no
5-D broadcast, which CUDA's quantized matmul gets wrong). The tokens held
outside the pages are attended in float32 as they are held: the first ones
of every sequence (``first``, read instead of their copies in the pages)
before the pages, the recent ones (``recent``) after them. ``sinks`` join
every softmax as a key with no value.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx

from . import kernels
from .rotation import rotate

# At most this many float32 scores exist at a time, so the workspace does not
# grow with the context. None: 2^26 on CUDA (a tile costs launches and, in
# prefill, a wait for the device), 2^24 elsewhere.
TILE_SCORES = None


def _on_cuda() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def tile_scores() -> int:
    if TILE_SCORES is not None:
        return TILE_SCORES
    return 1 << 26 if _on_cuda() else 1 << 24


class First(NamedTuple):
    """Unquantized copies of ``count`` tokens from stored row ``first`` (an
    int, or one per sequence: a (B,) array; negative where the pages no
    longer hold them), in the codecs' rotated domains. ``mask``: their
    visibility (B or 1, 1, L, count) where the call's mask does not say it
    (a bounded store's sinks). ``key``: what ``first`` is, hashable (masks
    made from it are made once a step), or None."""

    keys: mx.array
    values: mx.array
    first: object
    count: int
    mask: mx.array | None = None
    key: tuple | None = None


class Recent(NamedTuple):
    """``count`` tokens that follow the pages, held unquantized: in the codecs'
    rotated domains if ``rotated``, else only centered and weighted;
    ``incoming`` is the newest of them as the model made it, not yet written
    to the buffer (a kernel may write it; see ``kernels.Hold``)."""

    keys: mx.array
    values: mx.array
    count: int
    rotated: bool = True
    incoming: tuple | None = None


@dataclass
class Call:
    """One attention call over a store: what kernels and the loop read."""

    queries: mx.array  # (B, n_q_heads, L, D) as the model made them
    scale: float
    mask: object  # None, "causal" or an array over the stored rows
    sinks: mx.array | None
    key_codec: object
    value_codec: object
    key_pages: list
    value_pages: list
    length: int  # rows of the pages attended
    first: First | None = None
    recent: Recent | None = None
    key_mean: mx.array | None = None
    value_mean: mx.array | None = None
    key_weights: mx.array | None = None
    # (B, n_q_heads, 1, D): the key weights' reciprocals, as the store keeps
    # them for the queries' dtype, or None
    query_scale: mx.array | None = None
    # the store's: writes the incoming token into the buffer, returns ``recent``
    land: Callable | None = None
    # set by a kernel that wrote the incoming token: the new held buffers
    held: tuple | None = None

    @property
    def total(self) -> int:
        """Keys attended: the pages' rows and the recent tokens."""
        return self.length + (self.recent.count if self.recent else 0)

    def weighted_queries(self) -> mx.array:
        """The queries divided by the key weights (model dtype)."""
        if self.query_scale is not None:
            return (self.queries * self.query_scale).astype(self.queries.dtype)
        if self.key_weights is None:
            return self.queries
        weights = _repeat_heads(self.key_weights, self.queries.shape[1])
        return (self.queries / weights).astype(self.queries.dtype)

    def rotated_queries(self) -> mx.array:
        """Weighted, then rotated as the keys are (model dtype)."""
        return rotate(self.weighted_queries(), self.key_codec.rotation)

    def finish(self, out: mx.array) -> mx.array:
        """An output in the values' rotated domain, rotated back and with the
        value mean added."""
        return self.uncenter(rotate(out, self.value_codec.rotation, inverse=True))

    def uncenter(self, out: mx.array) -> mx.array:
        if self.value_mean is None:
            return out
        mean = _repeat_heads(self.value_mean, out.shape[1])
        return (out + mean).astype(out.dtype)

    def shifted_sinks(self):
        """Sink logits (B, n_q_heads, L) shifted as centered keys shift the
        scores, or None."""
        if self.sinks is None:
            return None
        sinks = self.sinks.astype(mx.float32)
        if sinks.ndim == 1:
            sinks = sinks[:, None]
        if self.key_mean is None:
            return sinks
        if self.value_mean is not None:
            raise ValueError(
                "A cache with centered values cannot attend with attention "
                "sinks (the probabilities do not sum to 1); center keys only."
            )
        mean = _repeat_heads(self.key_mean, self.queries.shape[1])
        shift = self.scale * (self.queries.astype(mx.float32) * mean).sum(axis=-1)
        return sinks - shift


def _repeat_heads(x: mx.array, n_heads: int) -> mx.array:
    """(B, n_kv_heads, 1, D) to (B, n_heads, 1, D): each KV head's row for the
    query heads that share it."""
    return mx.repeat(x, n_heads // x.shape[1], axis=1)


def attend(call: Call) -> mx.array:
    for kernel in kernels.attention_kernels():
        if kernel.applies(call):
            out = kernel.run(call)
            if out is not None:
                return out
    if call.recent is not None and call.recent.incoming is not None:
        call.recent = call.land()
    return ops_attention(call)


# ---------------------------------------------------------------------------
# The MLX-ops loop


def fold_queries(x: mx.array, n_kv_heads: int) -> mx.array:
    """(B, n_q_heads, L, ...) to (B, n_kv_heads, n_repeats * L, ...): the query
    heads that share a key head become more query rows."""
    B, n_q_heads, L = x.shape[:3]
    if n_q_heads == n_kv_heads:
        return x
    return x.reshape(B, n_kv_heads, n_q_heads // n_kv_heads * L, *x.shape[3:])


def keys_per_tile(n_queries: int, page_size: int) -> int:
    """A power of two (pages split into whole tiles), a multiple of 8 (CUDA's
    quantized matmul needs 16-byte aligned rows), at most a page."""
    tile = max(8, tile_scores() // max(n_queries, 1))
    return min(1 << (tile.bit_length() - 1), page_size)


def tiles(page_size: int, length: int, tile: int):
    """``(start, new, stop)`` key ranges covering a page up to ``length``.

    Tiles end at ``length`` rounded up to 64 keys, so a part-filled page costs
    what it holds. A tile is never narrower than 8 keys unless the page is: a
    short last tile starts early instead, its keys before ``new`` masked."""
    end = min(page_size, (length + 63) // 64 * 64)
    for new in range(0, min(page_size, length), tile):
        stop = min(new + tile, end)
        start = max(0, stop - (stop - new + 7) // 8 * 8)
        yield start, new, stop


def _fit_heads(mask, L, width, n_q_heads, n_kv_heads):
    """A mask (..., L, width) as the folded queries see it."""
    while mask.ndim < 4:
        mask = mask[None]
    mask = mx.broadcast_to(mask, (*mask.shape[:2], L, width))
    n_repeats = n_q_heads // n_kv_heads
    if mask.shape[1] == n_q_heads or n_repeats == 1:
        return fold_queries(mask, min(mask.shape[1], n_kv_heads))
    # one mask for all heads: repeat it for the query heads of a key head
    return mx.tile(mask, (1, 1, n_repeats, 1))


def _and_valid(mask, valid):
    if mask.dtype == mx.bool_:
        return mask & valid
    return mx.where(valid, mask, -float("inf"))


def tile_mask(mask, start, new, stop, length, L, n_q_heads, n_kv_heads, end):
    """The mask of keys ``start:stop`` for the folded queries (the last ``L`` of
    ``end`` keys), or None when all are visible; keys before ``new`` and from
    ``length`` on are masked."""
    n_repeats = n_q_heads // n_kv_heads
    k_pos = mx.arange(start, stop)
    in_range = None
    if start < new or stop > length:
        in_range = (k_pos >= new) & (k_pos < length)
    if isinstance(mask, str):
        if stop <= end - L + 1:
            return in_range
        causal = mx.arange(end - L, end)[:, None] >= k_pos[None]
        if in_range is not None:
            causal = causal & in_range
        return mx.tile(causal, (n_repeats, 1))
    if mask is None:
        return in_range
    part = mask[..., start : min(stop, length)]
    if in_range is not None:
        if stop > length:
            pad = [(0, 0)] * (part.ndim - 1) + [(0, stop - length)]
            part = mx.pad(part, pad)
        part = _and_valid(part, in_range)
    return _fit_heads(part, L, stop - start, n_q_heads, n_kv_heads)


def positions_mask(mask, positions, length, L, n_q_heads, n_kv_heads, end):
    """The mask of the keys at ``positions`` ((n,) or (B, n)) for the folded
    queries (the last ``L`` of ``end`` keys), or None when all are visible;
    positions from ``length`` on are masked. Negative positions (first tokens
    the pages do not hold, before the mask's columns) are seen by the queries
    at or after them."""
    n_repeats = n_q_heads // n_kv_heads
    valid = positions < length
    causal = positions[..., None, :] <= mx.arange(end - L, end)[:, None]
    if positions.ndim == 2:
        valid = valid[:, None, None]
        causal = causal[:, None]
    if isinstance(mask, str):
        return mx.tile(causal & valid, (n_repeats, 1))
    if mask is None:
        return valid
    while mask.ndim < 4:
        mask = mask[None]
    # (a negative index would wrap to the last columns)
    index = mx.clip(positions, 0, mask.shape[-1] - 1)
    if positions.ndim == 2:
        B = positions.shape[0]
        mask = mx.broadcast_to(mask, (B, *mask.shape[1:]))
        index = mx.broadcast_to(index[:, None, None], (*mask.shape[:3], index.shape[1]))
        mask = mx.take_along_axis(mask, index, axis=-1)
    else:
        mask = mx.take(mask, index, axis=-1)
    before = positions < 0
    if positions.ndim == 2:
        before = before[:, None, None]
    if mask.dtype != mx.bool_:
        causal = mx.where(causal, 0, -float("inf")).astype(mask.dtype)
    mask = mx.where(before, causal, mask)
    return _fit_heads(_and_valid(mask, valid), L, mask.shape[-1], n_q_heads, n_kv_heads)


def without_positions(mask, first, count, length, L, stored=None):
    """``mask`` over ``length`` keys (made an array) hiding each sequence's keys
    ``first`` to ``first + count`` (``first``: (B,)) among the first
    ``stored`` (default: all)."""
    k_pos = mx.arange(length)
    hidden = (k_pos >= first[:, None]) & (k_pos < first[:, None] + count)
    if stored is not None:
        hidden = hidden & (k_pos < stored)
    hidden = hidden[:, None, None]
    if mask is None:
        return ~hidden
    if isinstance(mask, str):
        rows = mx.arange(length - L, length)[:, None]
        mask = rows >= k_pos[None]
    if mask.dtype == mx.bool_:
        return mask & ~hidden
    return mx.where(hidden, -float("inf"), mask)


def _first_masks(mask, first: First, length, end, heads):
    """The first tokens' mask, and ``mask`` with their copies in the pages
    hidden where they start at a row per sequence (first tokens the pages do
    not hold yet are the recent ones, as for a single sequence)."""
    start, count = first.first, first.count
    if first.mask is not None:
        first_mask = _fit_heads(first.mask, heads[0], count, *heads[1:])
    else:
        rows = start if isinstance(start, int) else start[:, None]
        positions = rows + mx.arange(count)
        first_mask = positions_mask(mask, positions, length, *heads, end)
    if not isinstance(start, int):
        mask = without_positions(mask, start, count, end, heads[0], length)
    return first_mask, mask


def _recent_mask(mask, n, length, end, heads):
    """The mask of the ``n`` recent tokens after the pages' ``length`` rows."""
    return positions_mask(mask, length + mx.arange(n), end, *heads, end)


# masks of this decode step: the mask they were made from, {key: made}
_made = [None, {}]


def shared(key, mask, make, *args):
    """``make(*args)``, a mask made from a decode call's ``mask`` and ``key``
    (what else it is made from, hashable), made once for all the layers of a
    step: they attend with one mask, and each layer making it again adds
    small ops to the step (host time and launches)."""
    if _made[0] is not mask or len(_made[1]) >= 256:
        _made[:] = [mask, {}]
    if key not in _made[1]:
        _made[1][key] = make(*args)
    return _made[1][key]


class _Softmax:
    """The online softmax's state: the running maximum and the output with the
    row sums in its last column (one chain of results, so a tile's
    probabilities are freed before the next tile's scores exist)."""

    def __init__(self, running_max, out=None):
        self.running_max = running_max
        self.out = out

    def add(self, scores, mask, weigh):
        """Fold a tile's float32 ``scores`` (masked by ``mask``) in;
        ``weigh(probs)`` is ``probs @ values``."""
        if mask is not None:
            if mask.dtype == mx.bool_:
                scores = mx.where(mask, scores, -float("inf"))
            else:
                scores = scores + mask
        new_max = mx.maximum(self.running_max, scores.max(axis=-1, keepdims=True))
        # a row with no visible key yet keeps a zero correction, not NaN
        safe_max = mx.where(new_max == -float("inf"), 0, new_max)
        probs = mx.exp(scores - safe_max)
        out = mx.concatenate([weigh(probs), probs.sum(axis=-1, keepdims=True)], axis=-1)
        if self.out is not None:
            out = self.out * mx.exp(self.running_max - safe_max) + out
        self.running_max, self.out = new_max, out

    def result(self):
        return self.out[..., :-1] / mx.maximum(self.out[..., -1:], 1e-30)


def _kv_shape(call):
    """(KV heads, value head dim) of what the call attends."""
    if call.key_pages:
        return call.key_pages[0][0].shape[1], call.value_codec.dim(call.value_pages[0])
    held = call.recent if call.recent is not None else call.first
    return held.keys.shape[1], held.values.shape[-1]


def _start(call, rows, n_kv_heads, value_dim):
    """The softmax's state before the first tile: sinks are a key with no value."""
    B, n_q_heads, L, _ = call.queries.shape
    sinks = call.shifted_sinks()
    if sinks is None:
        return _Softmax(mx.full((B, n_kv_heads, rows, 1), -float("inf"), mx.float32))
    sinks = mx.broadcast_to(sinks, (B, n_q_heads, L))[..., None]
    out = mx.concatenate(
        [mx.zeros((B, n_kv_heads, rows, value_dim)), mx.ones((B, n_kv_heads, rows, 1))],
        axis=-1,
    )
    return _Softmax(fold_queries(sinks, n_kv_heads), out)


def _float_scores(queries, keys):
    return queries @ keys.astype(mx.float32).swapaxes(-1, -2)


def _weigh_tile(codec, tile):
    return lambda probs: codec.weigh(probs, tile).astype(mx.float32)


def _weigh_float(values):
    return lambda probs: probs @ values.astype(mx.float32)


def ops_attention(call: Call) -> mx.array:
    B, n_q_heads, L, _ = call.queries.shape
    key_codec, value_codec = call.key_codec, call.value_codec
    n_kv_heads, value_dim = _kv_shape(call)
    heads = (L, n_q_heads, n_kv_heads)
    length, end, mask = call.length, call.total, call.mask
    dtype = call.queries.dtype
    queries = call.rotated_queries().astype(mx.float32) * call.scale
    queries = fold_queries(queries, n_kv_heads)
    softmax = _start(call, queries.shape[2], n_kv_heads, value_dim)
    # half a score's expected error variance is |q|^2 / 2 times the key's
    # expected squared error per coordinate (``Codebook.debias``)
    half_energy = None
    if getattr(key_codec, "debias", False):
        half_energy = 0.5 * float(key_codec.debias) * mx.square(queries).sum(-1, True)
    made_from = (length, end, heads)
    if call.first is not None:
        made_from += (call.first.key, call.first.count)
    # a decode step's layers attend with one mask and the same first tokens
    step = L == 1 and (
        call.first is None or (call.first.key is not None and call.first.mask is None)
    )

    def once(key, make, *args):
        """``make(*args)``, a mask made from the call's: in decode, once a step."""
        if not step:
            return make(*args)
        return shared((key, made_from), call.mask, make, *args)

    skip = 0
    if call.first is not None:
        keys, values, first, count = call.first[:4]
        if isinstance(first, int):
            skip = max(first + count, 0)
        first_mask, mask = once(
            "first", _first_masks, mask, call.first, length, end, heads
        )
        softmax.add(
            _float_scores(queries, keys[..., :count, :]),
            first_mask,
            _weigh_float(values[..., :count, :]),
        )
    page_start = 0
    for k_page, v_page in zip(call.key_pages, call.value_pages):
        page_size = k_page[0].shape[2]
        if page_start >= length:
            break
        tile = keys_per_tile(B * n_q_heads * L, page_size)
        for start, new, stop in tiles(page_size, length - page_start, tile):
            # CUDA's quantized matmul takes row-contiguous operands only
            k_tile = tuple(mx.contiguous(x[:, :, start:stop]) for x in k_page)
            v_tile = tuple(mx.contiguous(x[:, :, start:stop]) for x in v_page)
            scores = key_codec.scores(queries, k_tile).astype(mx.float32)
            if half_energy is not None:
                variance = key_codec.error_variance(k_tile[1], queries.shape[-1])
                scores = scores - half_energy * variance.swapaxes(-1, -2)
            cols = (page_start + start, max(page_start + new, skip), page_start + stop)
            softmax.add(
                scores,
                once(("tile", cols), tile_mask, mask, *cols, length, *heads, end),
                _weigh_tile(value_codec, v_tile),
            )
            if L > 1 and scores.size >= tile_scores() // 64:
                # Lazily, every tile's scores would be computed before they
                # are reduced: a prefill tile is finished before the next
                # begins. (Decode tiles are small: one lazy graph.)
                mx.eval(softmax.out, softmax.running_max)
        page_start += page_size
    if call.recent is not None and call.recent.count:
        keys, values, n = call.recent.keys, call.recent.values, call.recent.count
        keys, values = keys[..., :n, :], values[..., :n, :]
        if not call.recent.rotated:
            keys = rotate(keys, key_codec.rotation)
            values = rotate(values, value_codec.rotation)
        softmax.add(
            _float_scores(queries, keys),
            once("recent", _recent_mask, mask, n, length, end, heads),
            _weigh_float(values),
        )
    out = softmax.result().astype(dtype).reshape(B, n_q_heads, L, -1)
    return call.finish(out)
