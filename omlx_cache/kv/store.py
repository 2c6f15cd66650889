"""One quantized KV store, composed: codecs, pages, a transform, spans, a layout.

``KVStore`` is a KV cache for one sequence and ``BatchKVStore`` for a batch
of left-padded ones (the server's), both with mlx-lm's cache protocol:
``update_and_fetch``, ``make_mask``, ``state`` / ``from_state``, ``trim``,
``nbytes``, and for batches ``merge``, ``extract``, ``filter``, ``extend``,
``prepare`` and ``finalize``. They own their attention
(``scaled_dot_product_attention``, which mlx-lm's models call through
``base.scaled_dot_product_attention``).

What a store holds:

- **pages** of encoded keys and values, one codec each (``codecs``: affine
  with its own bits and group size for keys and values, codebook, plain),
  allocated once and written in place; ``reserve`` makes the first page
  hold a whole generation.
- a **transform** (``transform``): centering and key weights, fixed at the
  first write, applied before encoding.
- **spans** (``spans``): tokens held outside the pages, unquantized: the
  first ``first`` tokens of every sequence, and the recent ones (a
  residual of ``recent`` tokens, or decode tokens a kernel asks to hold).
- a **layout**: every token, or a ``window``: a bounded layer (a sliding
  window, or ``--max-kv-size``) drops the pages no query can see any more;
  a query sees the last ``window - keep`` tokens and the first ``keep``,
  which the first span holds for good.

Rows: a store's tokens are rows ``0, 1, ...`` (in a batch, row ``r`` is
token ``r - left_padding[i]`` of sequence ``i``); the pages hold the rows
from ``dropped`` to ``written``, the recent span the ones after.
"""

import json

import mlx.core as mx
from mlx_lm.models.cache import register_cache_class

from .attention import Call, First, attend
from .codecs import Affine, codec, for_dim
from .kernels import hold as kernel_hold
from .rotation import rotate
from .spans import Spans, check_tokens, placed, with_first_rows
from .transform import Transform

DEFAULT_CODEC = Affine(8)


def _causal(N, offset, cols, left_padding=None, window=None):
    """Visibility (B or 1, 1, N, cols) of stored rows ``row(c) = c + (offset +
    N - cols)`` for queries at rows ``offset`` to ``offset + N``."""
    q = mx.arange(offset, offset + N)[:, None]
    rows = mx.arange(cols) + (offset + N - cols)
    mask = rows[None] <= q
    if window is not None:
        mask = mask & (q - rows[None] < window)
    mask = mask[None, None]
    if left_padding is not None:
        mask = mask & (rows >= left_padding[:, None, None, None])
    return mask


@register_cache_class
class KVStore:
    """A quantized KV cache for one sequence (see the module docstring).

    ``keys`` / ``values``: codecs, codec specs or ints (codebook bits);
    ``values`` defaults to the key codec. ``center`` (``"k"``, ``"kv"``),
    ``key_scale`` (``"q"``, ``"qk"``): the transform. ``first``: tokens of
    every sequence also kept unquantized; ``recent``: a residual (R to 2R - 1
    recent tokens held unquantized, R a multiple of 8). ``window`` / ``keep``:
    a bounded layer's layout.
    """

    page_size = 4096

    def __init__(
        self,
        keys=DEFAULT_CODEC,
        values=None,
        *,
        center="",
        key_scale="",
        first=0,
        recent=0,
        window=None,
        keep=0,
        page_size=None,
        fetch_dequantized=False,
    ):
        self.key_codec = codec(keys)
        self.value_codec = codec(keys if values is None else values)
        self.transform = Transform(center, key_scale)
        if window is not None:
            window = check_tokens(window, "window")
            keep = check_tokens(keep, "keep")
            if not 0 <= keep < window:
                raise ValueError(f"keep must be less than the window, got {keep}.")
            # the window's sinks are held for good in the first span
            first = max(first, keep)
            page_size = page_size or -(-window // 16) * 16
        self.window, self.keep = window, keep if window is not None else 0
        self.spans = Spans(first, recent)
        if self.transform.on and self.spans.first < 2:
            raise ValueError(
                "center and qscale are measured on each sequence's first tokens: "
                f"first must be 2 or more, got {self.spans.first}."
            )
        if self.spans.recent and window is not None:
            raise ValueError("A residual (recent) needs a store without a window.")
        self.page_size = int(page_size or type(self).page_size)
        self.key_pages, self.value_pages = [], []
        self.offset = 0
        self.left_padding = 0
        self._idx = 0  # rows written (pending and held ones included)
        self._written = 0  # rows in the pages (dropped ones included)
        self.dropped = 0
        self.reserve = None
        # the write that completes the first tokens, waiting for its queries
        self._pending = None
        # mean squared queries at the first positions, summed, and their count
        self._query_energy = self._query_count = None
        # update_and_fetch returns the keys and values dequantized (for
        # models that read them), else the pages
        self.fetch_dequantized = bool(fetch_dequantized)
        # ids of what ``update_and_fetch`` returned last, and whether this
        # store's attention was handed them back
        self._fetched = None
        self.attended = False

    # ------------------------------------------------------------------
    # settings

    @property
    def settings(self) -> dict:
        """What the store is, as ``__init__`` takes it (JSON-ready)."""
        return {
            "keys": self.key_codec.spec,
            "values": self.value_codec.spec,
            **self.transform.settings,
            **self.spans.settings,
            "window": self.window,
            "keep": self.keep,
            "page_size": self.page_size,
            **({"fetch_dequantized": True} if self.fetch_dequantized else {}),
        }

    def _batch_settings(self) -> dict:
        """What stores must share to be batched (the page size need not)."""
        return {k: v for k, v in self.settings.items() if k != "page_size"}

    @property
    def max_size(self):
        """A bounded layer's window (None: unbounded), as ``RotatingKVCache``."""
        return self.window

    @property
    def bits_per_element(self):
        """(key, value) bits per element for this store's head dims; None
        before the first tokens."""
        if not self.key_pages:
            return None
        return tuple(
            c.bits_per_element(c.dim(pages[0]))
            for c, pages in (
                (self.key_codec, self.key_pages),
                (self.value_codec, self.value_pages),
            )
        )

    # ------------------------------------------------------------------
    # writing

    def _tokens(self, rows):
        """Each sequence's tokens in the first ``rows`` rows, (B,)."""
        return mx.array([rows])

    def _fused(self) -> bool:
        """Whether the transform and the rotation are one matmul a part."""
        transform = self.transform
        rotations = (self.key_codec.rotation, self.value_codec.rotation)
        return transform.on and transform.fixed and rotations == ("hadamard",) * 2

    def _prepared(self, keys, values, rotated):
        if rotated and self._fused():
            return self.transform.rotated(keys, values)
        keys, values = self.transform(keys, values)
        if rotated:
            keys = rotate(keys, self.key_codec.rotation)
            values = rotate(values, self.value_codec.rotation)
        return keys, values

    def _add_page(self, keys, values, size):
        self.key_pages.append(self.key_codec.empty_page(keys, size))
        self.value_pages.append(self.value_codec.empty_page(values, size))

    @property
    def capacity(self) -> int:
        """Rows the allocated pages hold."""
        return sum(page[0].shape[2] for page in self.key_pages)

    def _write_rows(self, keys, values, rotated=False):
        """Encode ``keys`` and ``values`` (transformed; ``rotated``: in the
        codecs' rotated domains) into the pages after the rows written."""
        if not self._is_batch():
            # a sequence's first tokens are held in the first span only: the
            # pages begin after them
            skip = min(keys.shape[2], self.spans.first - self._written)
            if skip > 0:
                keys, values = keys[:, :, skip:], values[:, :, skip:]
                self._written += skip
                self.dropped = max(self.dropped, self._written)
        T = keys.shape[2]
        if T == 0:
            return
        row = self._written
        encoded = (
            self.key_codec.encode(keys, rotated),
            self.value_codec.encode(values, rotated),
        )
        start = row - self.dropped
        capacity = self.capacity
        while capacity < start + T:
            size = self.page_size
            if self.reserve and not self.key_pages:
                # the generation in one page; a multiple of 16 tokens keeps
                # the kernels' tiles in a page
                size = -(-self.reserve // 16) * 16
            self._add_page(keys, values, size)
            capacity += size
        for pages, parts in zip((self.key_pages, self.value_pages), encoded):
            _write(pages, parts, start, capacity)
        self._written += T

    def _max_padding(self) -> int:
        return 0

    def padding(self) -> tuple:
        """Each sequence's left padding, as ints."""
        return (self.left_padding,)

    def _keep_first(self, keys, values, row):
        """Keep those of ``keys`` and ``values`` (as the model made them),
        which go to rows ``row`` on, that are among each sequence's first
        tokens (transformed as the store is, rotated)."""
        n = self._max_padding() + self.spans.first - row
        if n > 0:
            k, v = keys[:, :, :n], values[:, :, :n]
            self.spans.keep_first(*self._prepared(k, v, True), row, self.left_padding)

    def _first_complete(self, rows) -> bool:
        """Whether the transform is fixed with the write that ends at row
        ``rows``: every sequence has its first tokens then (in a batch of
        unequal padding, or one has more)."""
        return rows >= self._max_padding() + self.spans.first

    def _add_queries(self, queries):
        """Add the squared queries at each sequence's first positions (the
        first left out) to what fixes the transform."""
        B, _, L, D = queries.shape
        rows = mx.arange(self._idx - L, self._idx)
        positions = rows[None] - self.left_padding_array()[:, None]  # (B, L)
        first = mx.minimum(self._tokens(self._idx), self.spans.first)[:, None]
        at = ((positions >= 1) & (positions < first)).astype(mx.float32)
        energy = (mx.square(queries.astype(mx.float32)) * at[:, None, :, None]).sum(
            axis=2, keepdims=True
        )
        n_kv_heads = self._kv_heads(B)
        energy = energy.reshape(B, n_kv_heads, -1, 1, D).mean(axis=2)
        count = at.sum(axis=1)
        if self._query_energy is not None:
            energy, count = energy + self._query_energy, count + self._query_count
        self._query_energy, self._query_count = energy, count

    def _kv_heads(self, B):
        if self.spans.first_keys is not None:
            return self.spans.first_keys.shape[1]
        return self._pending[0].shape[1]

    def _fix_transform(self):
        """Set the transform from the first tokens (and the queries seen at
        their positions), and store the first tokens transformed."""
        spans = self.spans
        if self.transform.fixed or spans.first_keys is None:
            return
        keys = rotate(spans.first_keys, self.key_codec.rotation, inverse=True)
        values = rotate(spans.first_values, self.value_codec.rotation, inverse=True)
        energy = None
        if self._query_energy is not None:
            count = mx.maximum(self._query_count, 1)[:, None, None, None]
            energy = self._query_energy / count
        written = mx.minimum(self._tokens(self._idx), spans.first)
        self.transform.fix(keys, values, energy, written)
        spans.first_keys, spans.first_values = (
            x.astype(y.dtype)
            for x, y in zip(self._prepared(keys, values, True), (keys, values))
        )
        if spans.n_held:
            # a residual's held tokens, as the first ones, were held as they came
            n = spans.n_held
            held = (spans.held_keys[:, :, :n], spans.held_values[:, :, :n])
            raw = (
                rotate(x, c.rotation, inverse=True)
                for x, c in zip(held, (self.key_codec, self.value_codec))
            )
            spans.held_keys, spans.held_values = (
                x.astype(y.dtype) for x, y in zip(self._prepared(*raw, True), held)
            )
        self._query_energy = self._query_count = None

    def _holds(self, keys, values) -> bool:
        """Whether a decode token waits unquantized for a kernel."""
        spans = self.spans
        if spans.recent or keys.shape[2] != 1 or self._pending is not None:
            return False
        if self._written < self._max_padding() + spans.first:
            # the first tokens are kept as they are written to the pages
            return False
        if spans.hold is None:
            spans.hold = kernel_hold(keys, values, self.key_codec, self.value_codec)
            spans.hold = spans.hold or False
        return bool(spans.hold)

    def update_and_fetch(self, keys, values):
        T = keys.shape[2]
        self._drop(self._drop_to())
        if self.empty():
            # a head dim the codec cannot store: a group size that divides
            # it, else unquantized (the load line says so)
            self.key_codec = for_dim(self.key_codec, keys.shape[-1])
            self.value_codec = for_dim(self.value_codec, values.shape[-1])
        if not self.transform.fixed and self._first_complete(self._idx + T):
            # the transform is set from the first tokens and the queries at
            # their positions, which come with attention
            self._flush()
            self._pending = (keys, values, self._idx)
        elif self._holds(keys, values):
            released = self.spans.buffer(keys, values, self._prepare_held)
            if released is not None:
                self._write_rows(*released, rotated=self.spans.rotated)
        elif self.spans.recent:
            # a pending write goes first (written when no attention came)
            self._flush_pending()
            self._keep_first(keys, values, self._idx)
            aged = self.spans.age(*self._prepared(keys, values, rotated=True))
            if aged is not None:
                self._write_rows(*aged, rotated=True)
        else:
            self._flush()
            self._keep_first(keys, values, self._idx)
            self._write_rows(*self.transform(keys, values))
        self._idx += T
        self.offset = self.offset + T
        # a model that attends by itself, or a layer reading this one's cache,
        # reads the keys and values dequantized (lazy, but each layer's graph
        # costs host time a decode step: only for models that need them)
        if self.fetch_dequantized:
            fetched = self.dequantized()
        else:
            fetched = self.key_pages, self.value_pages
        self._fetched = tuple(map(id, fetched))
        return fetched

    def _prepare_held(self, keys, values):
        return self._prepared(keys, values, rotated=self.spans.rotated)

    def _flush_pending(self):
        """Fix the transform (with the queries seen so far) and write the
        write that waited for it."""
        if self._pending is None:
            return
        keys, values, row = self._pending
        self._pending = None
        self._keep_first(keys, values, row)
        self._fix_transform()
        self._keep_first(keys, values, row)
        if self.spans.recent:
            aged = self.spans.age(*self._prepared(keys, values, rotated=True))
            if aged is not None:
                self._write_rows(*aged, rotated=True)
        else:
            self._write_rows(*self.transform(keys, values))

    def _flush_held(self):
        """Write the kernel's held decode tokens to the pages (a residual's
        stay held)."""
        if self.spans.recent or not self.spans.n_held:
            return
        released = self.spans.release(self._prepare_held)
        self._write_rows(*released, rotated=self.spans.rotated)

    def _flush(self):
        self._flush_pending()
        self._flush_held()

    def _release_all(self):
        """Write every held token to the pages (a residual's too)."""
        released = self.spans.release(self._prepare_held)
        if released is not None:
            self._write_rows(*released, rotated=self.spans.rotated)
            self._idx = self._written
        if self.spans.recent:
            self.spans.held_keys = self.spans.held_values = None

    # ------------------------------------------------------------------
    # the window

    def _drop_to(self) -> int:
        """Rows the pages will have dropped once the next write's queries
        (from row ``_idx`` on) attend: whole pages before the first row they
        see (the sinks are in the first span)."""
        if self.window is None:
            return self.dropped
        visible_from = self._idx - (self.window - self.keep) + 1
        dropped = self.dropped
        for page in self.key_pages:
            size = page[0].shape[2]
            if dropped + size > min(visible_from, self._written):
                break
            dropped += size
        return dropped

    def _drop(self, target):
        while self.dropped < target:
            size = self.key_pages[0][0].shape[2]
            del self.key_pages[0], self.value_pages[0]
            self.dropped += size
        # a sliding window's first tokens go once no query sees them
        if self.window is None or self.keep or self.spans.first_keys is None:
            return
        visible_from = self._idx - self.window + 1
        if visible_from >= self._max_padding() + self.spans.first:
            self.spans.drop_first()

    def make_mask(self, N, return_array=False, window_size=None):
        window = self.window - self.keep if self.window else window_size
        if window is None:
            if N == 1:
                return None
            if not return_array:
                return "causal"
        drop_to = self._drop_to()
        # the columns: the rows a query sees, the first span's in front
        front = self._front() if drop_to == self.dropped else 0
        cols = self._idx + N - drop_to + front
        return _causal(N, self._idx, cols, None, window)

    def _first_mask(self, queries):
        """A bounded store's first span's visibility: its sinks always, the
        others within the window."""
        N = queries.shape[2]
        n = self.spans.first
        rows = mx.arange(n) + self.left_padding_array()[:, None]  # (B, n)
        q = mx.arange(self._idx - N, self._idx)[:, None]
        in_window = q - rows[:, None] < self.window - self.keep
        visible = (rows[:, None] <= q) & (in_window | (mx.arange(n) < self.keep))
        return visible[:, None]

    def left_padding_array(self):
        return mx.array([self.left_padding])

    # ------------------------------------------------------------------
    # attention

    def _first(self, queries):
        first = self.spans.first_tokens(self.left_padding)
        if first is None:
            return None
        start = first.first - self.dropped if self.dropped else first.first
        mask = self._first_mask(queries) if self.window is not None else None
        key = (self.padding(), self.dropped)
        return First(first.keys, first.values, start, first.count, mask, key)

    def scaled_dot_product_attention(
        self, queries, keys, values, scale, mask, sinks=None
    ):
        fetched = (id(keys), id(values)) == self._fetched
        self.attended = self.attended or fetched
        if isinstance(keys, mx.array) and not fetched:
            # keys and values the model made from what it fetched (an MLA
            # latent's projections): attended as they are
            return mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=scale, mask=mask, sinks=sinks
            )
        if not self.transform.fixed and self.transform.key_scale:
            self._add_queries(queries)
        self._flush_pending()
        spans = self.spans
        columns = self._idx - self.dropped
        if isinstance(mask, mx.array) and mask.shape[-1] > columns:
            # made before the write, which may have kept more rows out of the
            # pages (first tokens): the columns end at the same row
            mask = mask[..., -columns:]
        call = Call(
            queries,
            scale,
            mask,
            sinks,
            self.key_codec,
            self.value_codec,
            self.key_pages,
            self.value_pages,
            length=self._written - self.dropped,
            first=self._first(queries),
            recent=spans.recent_tokens(),
            key_mean=self.transform.key_mean,
            value_mean=self.transform.value_mean,
            key_weights=self.transform.key_weights,
            query_scale=self.transform.query_scale(queries.dtype, queries.shape[1]),
            land=self._land,
        )
        out = attend(call)
        if call.held is not None:
            # a kernel wrote the incoming token into the buffer
            spans.held_keys, spans.held_values = call.held
            spans.incoming = None
        return out

    def _land(self):
        self.spans.land(self._prepare_held)
        return self.spans.recent_tokens()

    # ------------------------------------------------------------------
    # rows, for batches

    def _page_rows(self, start, stop, pad):
        """This store's encoded page rows from batch row ``start`` to ``stop``
        once right-justified by ``pad`` rows: (key parts, value parts, the
        first batch row they go to), or None."""
        lo, hi = self.dropped + pad, min(self._written + pad, stop)
        if hi <= lo:
            return None
        keys, values = self._encoded()
        rows = slice(0, hi - lo)
        return (
            tuple(x[:, :, rows] for x in keys),
            tuple(x[:, :, rows] for x in values),
            lo - start,
        )

    def _held_rows(self, count, pad, dtype):
        """The last ``count`` rows of this store once right-justified by
        ``pad`` rows, unquantized in the codecs' rotated domains (page rows
        decoded, in ``dtype``, as attention reads them), or None where it has
        none."""
        n_held = self.spans.n_held
        from_pages = min(count - n_held, self._written - self.dropped)
        # rows before the pages: first tokens a sequence holds in its first
        # span only
        before = self._front()
        from_first = min(count - n_held - max(from_pages, 0), before)
        if count <= 0 or (n_held == 0 and from_pages <= 0 and from_first <= 0):
            return None
        parts = []
        if from_first > 0:
            rows = slice(self.dropped - from_first, self.dropped)
            parts.append(
                tuple(
                    x[:, :, rows].astype(dtype)
                    for x in (self.spans.first_keys, self.spans.first_values)
                )
            )
        if from_pages > 0:
            keys, values = self._encoded()
            rows = slice(keys[0].shape[2] - from_pages, None)
            parts.append(
                (
                    self.key_codec.decode(tuple(x[:, :, rows] for x in keys), dtype),
                    self.value_codec.decode(
                        tuple(x[:, :, rows] for x in values), dtype
                    ),
                )
            )
        if n_held:
            parts.append(
                (
                    self.spans.held_keys[:, :, :n_held],
                    self.spans.held_values[:, :, :n_held],
                )
            )
        keys, values = (mx.concatenate(x, axis=2) for x in zip(*parts))
        return keys, values

    # ------------------------------------------------------------------
    # the protocol

    def empty(self):
        return not self.key_pages and self._pending is None and not self.spans.n_held

    def size(self):
        return self._idx

    def _first_skip(self) -> int:
        """Rows of the first tokens the pages do not hold (a sequence's are
        in its first span only; a batch writes every row to its pages)."""
        return 0 if self._is_batch() else min(self.spans.first, self._written)

    def _front(self) -> int:
        """Rows before the pages a query reads from the first span: a
        sequence's first tokens, which its store holds there only (none
        once a window dropped rows)."""
        skip = self._first_skip()
        return skip if self.dropped == skip else 0

    def _window_dropped(self) -> bool:
        """Whether a window dropped rows no query sees: pages, or a sliding
        window's first span."""
        if self.window is None:
            return False
        gone = self.spans.first and self._written and self.spans.first_keys is None
        return self.dropped > self._first_skip() or bool(gone)

    def is_trimmable(self):
        return not self._window_dropped()

    def trim(self, n):
        # rows a window dropped are gone: trimmed no further (the first
        # tokens the pages skip are in the first span)
        n = min(self._idx - (self.dropped if self._window_dropped() else 0), n)
        self._flush_pending()
        if self.spans.recent:
            held = self.spans.trim_held(n)
        else:
            self._flush_held()
            held = 0
        self._written -= n - held
        # into the first tokens: the pages hold none of the rows left
        self.dropped = min(self.dropped, self._written)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def _model_dtype(self):
        for x in (
            self._pending and self._pending[0],
            self.spans.first_keys,
            self.spans.held_keys,
        ):
            if x is not None:
                return x.dtype
        codec_ = self.key_codec
        if self.key_pages and isinstance(codec_, Affine) and codec_.offset == "float":
            return self.key_pages[0][1].dtype
        return mx.float32

    def _decoded_pages(self, dtype):
        """The pages' rows decoded (rotated domain), a batch's first tokens
        as the first span keeps them, or None."""
        length = self._written - self.dropped
        if length <= 0:
            return None
        keys, values = (
            mx.concatenate([c.decode(p, dtype) for p in pages], axis=2)[:, :, :length]
            for c, pages in (
                (self.key_codec, self.key_pages),
                (self.value_codec, self.value_pages),
            )
        )
        spans = self.spans
        if not self._is_batch() or spans.first_keys is None:
            return keys, values
        # each sequence's first tokens, from row left_padding[i] on
        first = self.left_padding - self.dropped
        return (
            with_first_rows(keys, spans.first_keys, first, spans.first),
            with_first_rows(values, spans.first_values, first, spans.first),
        )

    def _held(self):
        """The held tokens (rotated domain), an incoming one prepared, or None."""
        spans, n = self.spans, self.spans.n_held
        if not n:
            return None
        held = [x[:, :, :n] for x in (spans.held_keys, spans.held_values)]
        if spans.incoming is not None:
            last = self._prepare_held(*spans.incoming)
            held = [
                mx.concatenate([x[:, :, : n - 1], y.astype(x.dtype)], axis=2)
                for x, y in zip(held, last)
            ]
        if not spans.rotated:
            codecs = (self.key_codec, self.value_codec)
            held = [rotate(x, c.rotation) for x, c in zip(held, codecs)]
        return tuple(held)

    def dequantized(self):
        """(keys, values) (B, n_kv_heads, rows, D) as the model made them, the
        pages decoded: each row a query sees, in order (the first tokens the
        pages do not hold, the pages, the held tokens, a write waiting for
        the transform). What a model that attends by itself reads: lazy, so
        computed only if read. (A window's sinks are not among them.)"""
        spans = self.spans
        dtype = self._model_dtype()
        parts = []
        front = self._front()
        if front and spans.first_keys is not None:
            first = (spans.first_keys, spans.first_values)
            parts.append(tuple(x[:, :, :front] for x in first))
        for part in (self._decoded_pages(dtype), self._held()):
            if part is not None:
                parts.append(part)
        out = []
        if parts:
            keys, values = (
                mx.concatenate([x.astype(dtype) for x in xs], axis=2)
                for xs in zip(*parts)
            )
            keys = rotate(keys, self.key_codec.rotation, inverse=True)
            values = rotate(values, self.value_codec.rotation, inverse=True)
            keys, values = self.transform.undo(keys, values)
            out.append((keys.astype(dtype), values.astype(dtype)))
        if self._pending is not None:
            out.append(self._pending[:2])
        if not out:
            return None, None
        if len(out) == 1:
            return out[0]
        return tuple(mx.concatenate(xs, axis=2) for xs in zip(*out))

    def keys_and_values(self):
        """For a model that reads its keys (``fetch_dequantized``), its rows
        dequantized, as ``update_and_fetch`` gives them (AFM7's KV-reuse
        layers read the last layer's cache so); else the encoded pages."""
        if self.fetch_dequantized:
            return self.dequantized()
        return self._encoded()

    def _encoded(self):
        """The encoded keys and values of the pages, one tuple each (a copy
        when there are several pages)."""
        self._flush()
        length = self._written - self.dropped
        return tuple(
            tuple(x[:, :, :length] for x in _joined(pages))
            for pages in (self.key_pages, self.value_pages)
        )

    @property
    def nbytes(self):
        pages = sum(
            x.nbytes for page in self.key_pages + self.value_pages for x in page
        )
        return pages + self.spans.nbytes + self.transform.nbytes

    @property
    def bytes_per_token(self):
        """Bytes a sequence's token takes in the pages (None before the first
        write): what the server's KV cache budget counts (``nbytes`` holds
        whole pages and the first tokens)."""
        if not self.key_pages:
            return None
        page = (*self.key_pages[0], *self.value_pages[0])
        return sum(x.nbytes / x.shape[-2] for x in page) / page[0].shape[0]

    @property
    def state(self):
        # a kernel's held decode tokens go to the pages: a state does not say
        # in which domain they are held (``kernels.Hold.rotated``), and a
        # store loaded elsewhere may hold none
        self._flush()
        spans = self.spans
        return (
            [list(page) for page in self.key_pages],
            [list(page) for page in self.value_pages],
            spans.first_keys,
            spans.first_values,
            spans.held_keys if spans.n_held else None,
            spans.held_values if spans.n_held else None,
            *self.transform.arrays(),
            *self._rows_state(),
            json.dumps(self.settings),
        )

    def _rows_state(self):
        return (self.offset, self._idx, self._written, self.dropped, self.spans.n_held)

    @state.setter
    def state(self, v):
        # built apart and taken whole: a rejected state leaves the store as it was
        self.__dict__.update(self._from_state(v).__dict__)

    def _from_state(self, v):
        """A store of this type holding the state ``v`` (ValueError if it is
        not a consistent one)."""
        *arrays, settings = v
        try:
            settings = json.loads(settings)
        except (TypeError, ValueError):
            raise ValueError(
                f"{type(self).__name__}: the state's settings are not JSON."
            ) from None
        if len(arrays) != 14:
            raise ValueError(
                f"{type(self).__name__}: a state has 15 items, got {len(v)}."
            )
        key_pages, value_pages, *rest = arrays
        spans, means, rows = rest[:4], rest[4:7], rest[7:]
        try:
            if self._is_batch():
                fresh = type(self)([0], **settings)
            else:
                fresh = type(self)(**settings)
        except TypeError as error:
            raise ValueError(
                f"{type(self).__name__}: the state's settings are not a store's: "
                f"{error}"
            ) from None
        key_pages = [tuple(p) for p in key_pages]
        value_pages = [tuple(p) for p in value_pages]
        _check_pages(fresh.key_codec, key_pages, "key")
        _check_pages(fresh.value_codec, value_pages, "value")
        if len(key_pages) != len(value_pages):
            raise ValueError("Cache state has key and value pages of different counts.")
        fresh.transform = Transform(
            **fresh.transform.settings,
            key_mean=means[0],
            value_mean=means[1],
            key_weights=means[2],
        )
        fresh.key_pages, fresh.value_pages = key_pages, value_pages
        fresh.spans.first_keys, fresh.spans.first_values = spans[0], spans[1]
        if (spans[0] is None) != (spans[1] is None):
            raise ValueError("Cache state has kept keys without values or back.")
        if (spans[2] is None) != (spans[3] is None):
            raise ValueError("Cache state has held keys without values or back.")
        fresh._set_rows(*rows)
        if spans[2] is not None:
            if not fresh.spans.recent:
                raise ValueError(
                    "Cache state holds recent tokens but no residual (recent=0)."
                )
            fresh.spans.held_keys, fresh.spans.held_values = spans[2], spans[3]
            if fresh.spans.held_keys.shape[2] < fresh.spans.n_held:
                raise ValueError("Cache state holds fewer recent tokens than it says.")
        elif fresh.spans.n_held:
            raise ValueError("Cache state says it holds recent tokens but has none.")
        if fresh.capacity < fresh._written - fresh.dropped:
            raise ValueError("Cache state holds fewer tokens than its offset.")
        _check_shapes(fresh)
        return fresh

    def _is_batch(self) -> bool:
        return False

    def _set_rows(self, offset, idx, written, dropped, n_held):
        self.offset, self._idx, self._written = int(offset), int(idx), int(written)
        self.dropped, self.spans.n_held = int(dropped), int(n_held)
        if (
            self._written + self.spans.n_held != self._idx
            or self.dropped > self._written
        ):
            raise ValueError("Cache state's row counts do not agree.")

    @classmethod
    def from_state(cls, state):
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    @classmethod
    def merge(cls, caches):
        return BatchKVStore.merge(caches)


def _check_pages(codec_, pages, name):
    if any(len(page) != codec_.parts for page in pages):
        raise ValueError(f"Cache state does not hold {codec_.spec} {name} pages.")


def _check_shapes(store):
    """ValueError unless a state's kept and held tokens and its transform
    have the pages' sequences, heads and head dims."""
    spans, transform = store.spans, store.transform
    if store.key_pages:
        page = store.key_pages[0][0], store.value_pages[0][0]
        B, heads = page[0].shape[:2]
        dims = (
            store.key_codec.dim(store.key_pages[0]),
            store.value_codec.dim(store.value_pages[0]),
        )
    else:
        like = (spans.held_keys, spans.held_values)
        if like[0] is None:
            like = (spans.first_keys, spans.first_values)
        if like[0] is None:
            return
        B, heads = like[0].shape[:2]
        dims = (like[0].shape[3], like[1].shape[3])
    arrays = [
        ("key mean", transform.key_mean, (B, heads, 1, dims[0])),
        ("value mean", transform.value_mean, (B, heads, 1, dims[1])),
        ("key weights", transform.key_weights, (B, heads, 1, dims[0])),
        ("kept keys", spans.first_keys, (B, heads, spans.first, dims[0])),
        ("kept values", spans.first_values, (B, heads, spans.first, dims[1])),
    ]
    for name, x, d in (
        ("held keys", spans.held_keys, dims[0]),
        ("held values", spans.held_values, dims[1]),
    ):
        if x is not None:
            arrays.append((name, x, (B, heads, x.shape[2], d)))
    for name, x, shape in arrays:
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(
                f"Cache state's {name}: shape {tuple(x.shape)}, where its pages "
                f"and settings give {shape}."
            )


def _write(pages, encoded, start, capacity):
    """Write ``encoded`` from stored row ``start`` on into ``pages``, which hold
    ``capacity`` rows; visited from the last page back, as writes go to the
    end."""
    T = encoded[0].shape[2]
    page_end = capacity
    for page in reversed(pages):
        if page_end <= start:
            break
        page_start = page_end - page[0].shape[2]
        lo, hi = max(start, page_start), min(start + T, page_end)
        if lo < hi:
            whole = hi - lo == T
            for dst, x in zip(page, encoded):
                # a decode step's token goes in whole, with no slice to build
                src = x if whole else x[:, :, lo - start : hi - start]
                dst[:, :, lo - page_start : hi - page_start] = src
        page_end = page_start


def _joined(pages):
    """One tuple of a codec's arrays (a copy for several pages)."""
    if len(pages) == 1:
        return pages[0]
    return tuple(mx.concatenate(parts, axis=2) for parts in zip(*pages))


@register_cache_class
class BatchKVStore(KVStore):
    """``KVStore`` for a batch of left-padded sequences: ``offset`` and
    ``left_padding`` are (B,) arrays, ``merge`` (of ``KVStore``s),
    ``extract``, ``filter`` and ``extend`` move encoded pages without
    decoding them."""

    def __init__(self, left_padding, keys=DEFAULT_CODEC, values=None, **settings):
        super().__init__(keys, values, **settings)
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._right_padding = None
        self._valid_stop = None
        self._tails = None

    def _is_batch(self) -> bool:
        return True

    @property
    def left_padding(self):
        return self._left_padding

    @left_padding.setter
    def left_padding(self, value):
        self._left_padding = value
        self._padding = None

    def padding(self) -> tuple:
        # read from the device once, not at every layer's every step
        if self._padding is None:
            self._padding = tuple(self._left_padding.tolist())
        return self._padding

    def _max_padding(self) -> int:
        return max(self.padding(), default=0)

    def _first_complete(self, rows) -> bool:
        # A sequence's rows after its first tokens are read from the pages:
        # with unequal left padding the transform is fixed before the first
        # of them is written, the more padded sequences' from the first
        # tokens they have then (none: no transform).
        padding = self.padding()
        if not padding:
            return False
        first = self.spans.first
        return rows >= min(max(padding) + first, min(padding) + first + 1)

    def left_padding_array(self):
        return self.left_padding

    def _tokens(self, rows):
        # a right-padded prompt's padding is not its tokens
        if self._valid_stop is not None:
            rows = mx.minimum(self._valid_stop, rows)
        return rows - self.left_padding

    def make_mask(self, N, return_array=False, window_size=None):
        window = self.window - self.keep if self.window else window_size
        cols = self._idx + N - self._drop_to()
        return _causal(N, self._idx, cols, self.left_padding, window)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if not self.empty():
                raise ValueError("Left padding can only be added to an empty cache.")
            self.left_padding = self.left_padding + mx.array(left_padding)
            self.offset = self.offset - mx.array(left_padding)
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)
        if lengths is not None:
            # right padding is left out of what sets the transform
            self._valid_stop = mx.array(lengths) + self._idx

    def update_and_fetch(self, keys, values):
        padded = self._right_padding is not None and self._valid_stop is not None
        if padded and self.spans.recent:
            self._keep_tails(keys, values)
        return super().update_and_fetch(keys, values)

    def _keep_tails(self, keys, values):
        """Keep each right-padded sequence's last 2R rows as the model made
        them: a residual's held rows once ``finalize`` moves the prompts to the
        end (a short prompt's rows are in the pages by then, quantized)."""
        if self._tails is None:
            size = 2 * self.spans.recent
            self._tails = tuple(
                mx.zeros((*x.shape[:2], size, x.shape[3]), x.dtype)
                for x in (keys, values)
            )
            before = None if self.empty() else self._held_rows(size, 0, keys.dtype)
            if before is not None:
                codecs = (self.key_codec, self.value_codec)
                raw = self.transform.undo(
                    *(
                        rotate(x, c.rotation, inverse=True)
                        for x, c in zip(before, codecs)
                    )
                )
                self._place_tails(raw, self._idx - before[0].shape[2])
        self._place_tails((keys, values), self._idx)

    def _place_tails(self, rows, start):
        size = self._tails[0].shape[2]
        pos = self._valid_stop[:, None] - size + mx.arange(size) - start
        self._tails = tuple(placed(t, x, pos) for t, x in zip(self._tails, rows))

    def finalize(self):
        """Move right-padded prompts to the right end (once, after prefill)."""
        if self._right_padding is None:
            return
        self._flush()
        shift = self._right_padding[:, None]
        if self._tails is not None:
            self._hold_tails()
        elif self.spans.n_held:
            self._roll_held(self._right_padding)
        if self.key_pages:
            # the rows the roll brings to the front are padding, or older than
            # any a window still sees
            keys, values = (_joined(p) for p in (self.key_pages, self.value_pages))
            self.key_pages = [tuple(_roll(x, shift) for x in keys)]
            self.value_pages = [tuple(_roll(x, shift) for x in values)]
        self.offset = self.offset - self._right_padding
        self.left_padding = self.left_padding + self._right_padding
        self._right_padding = None

    def _hold_tails(self):
        spans, n = self.spans, self.spans.n_held
        if n:
            rows = (x[:, :, x.shape[2] - n :] for x in self._tails)
            held = self._prepared(*rows, rotated=True)
            spans.held_keys, spans.held_values = (
                x.astype(y.dtype)
                for x, y in zip(held, (spans.held_keys, spans.held_values))
            )
        self._tails = None

    def _roll_held(self, shift):
        """A residual's held rows rolled right by each sequence's ``shift``: the
        rows that come in from the pages, decoded."""
        spans, n = self.spans, self.spans.n_held
        P = max(shift.tolist())
        held = (spans.held_keys[:, :, :n], spans.held_values[:, :, :n])
        decoded = self._held_rows(n + P, 0, spans.held_keys.dtype)
        combined = tuple(
            mx.concatenate([mx.zeros_like(x[:, :, : n + P - d.shape[2]]), d], axis=2)
            if d.shape[2] < n + P
            else d
            for x, d in zip(held, decoded)
        )
        index = (P - shift)[:, None] + mx.arange(n)
        spans.held_keys, spans.held_values = (
            mx.take_along_axis(
                x,
                mx.broadcast_to(index[:, None, :, None], (*x.shape[:2], n, x.shape[3])),
                2,
            )
            for x in combined
        )

    @property
    def state(self):
        return (*super().state[:-1], self.left_padding, json.dumps(self.settings))

    @state.setter
    def state(self, v):
        *rest, left_padding, settings = v
        fresh = self._from_state((*rest, settings))
        fresh.left_padding = left_padding
        self.__dict__.update(fresh.__dict__)

    def _rows_state(self):
        return (self.offset, self._idx, self._written, self.dropped, self.spans.n_held)

    def _set_rows(self, offset, idx, written, dropped, n_held):
        self.offset = offset
        self._idx, self._written = int(idx), int(written)
        self.dropped, self.spans.n_held = int(dropped), int(n_held)
        if self._written + self.spans.n_held != self._idx:
            raise ValueError("Cache state's row counts do not agree.")

    def filter(self, batch_indices):
        """Keep the sequences ``batch_indices``, dropping left padding they
        all share (whole pages of it, and a view into the first page)."""
        self._flush()
        if not isinstance(batch_indices, mx.array):
            batch_indices = mx.array(batch_indices)
        for pages in (self.key_pages, self.value_pages):
            pages[:] = [tuple(x[batch_indices] for x in page) for page in pages]
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        self.transform.take(batch_indices)
        spans = self.spans
        if spans.first_keys is not None:
            spans.first_keys = spans.first_keys[batch_indices]
            spans.first_values = spans.first_values[batch_indices]
        if spans.n_held:
            spans.held_keys = spans.held_keys[batch_indices]
            spans.held_values = spans.held_values[batch_indices]
        shared = min(self.padding(), default=0) - self.dropped
        # (padding rows a residual still holds stay there, masked)
        shared = min(shared, self._written - self.dropped)
        if shared <= 0 or self.window is not None:
            return
        for pages in (self.key_pages, self.value_pages):
            skip = shared
            while pages and pages[0][0].shape[2] <= skip:
                skip -= pages.pop(0)[0].shape[2]
            if skip:
                pages[0] = tuple(x[:, :, skip:] for x in pages[0])
        self._idx -= shared
        self._written -= shared
        self.left_padding = self.left_padding - shared

    def extend(self, other):
        """Append the sequences of ``other`` (a store of the same settings)."""
        _combine(self, [self, other])

    def extract(self, idx):
        """Sequence ``idx`` as a ``KVStore`` (a copy, its padding dropped)."""
        self._flush()
        settings = self.settings
        store = KVStore(**settings)
        padding = self.padding()[idx]
        n = self._idx - padding
        store.offset = store._idx = n
        store._written = self._written - padding
        # as a sequence's store lays its rows out: its first tokens in the
        # first span only, the pages after them
        store.dropped = max(self.dropped - padding, store._first_skip(), 0)
        skip = store.dropped + padding - self.dropped
        keys, values = self._encoded()
        store.key_pages, store.value_pages = (
            [tuple(mx.contiguous(x[idx : idx + 1, :, skip:]) for x in stored)]
            for stored in (keys, values)
        )
        spans = self.spans
        if spans.n_held:
            store.spans.held_keys = mx.contiguous(spans.held_keys[idx : idx + 1])
            store.spans.held_values = mx.contiguous(spans.held_values[idx : idx + 1])
            store.spans.n_held = spans.n_held
            store.spans.hold = spans.hold
        if spans.first_keys is not None:
            store.spans.first_keys, store.spans.first_values = (
                mx.contiguous(x[idx : idx + 1])
                for x in (spans.first_keys, spans.first_values)
            )
        store.transform = Transform(
            **self.transform.settings,
            **{
                name: None if x is None else x[idx : idx + 1]
                for name, x in zip(
                    ("key_mean", "value_mean", "key_weights"), self.transform.arrays()
                )
            },
        )
        return store

    @classmethod
    def merge(cls, caches):
        """One batch of ``KVStore``s, left-padded to the longest."""
        _check_batchable(caches)
        batch = cls([0] * len(caches), **caches[0].settings)
        _combine(batch, caches)
        return batch


def _rows(store):
    return store.offset.shape[0] if isinstance(store.offset, mx.array) else 1


def _combine(batch, stores):
    """Set ``batch`` to the sequences of ``stores`` laid end to end,
    right-justified at the longest. A residual's held tokens stay held: rows
    that one store holds and another has written to its pages are held
    decoded, as attention reads them."""
    _check_batchable(stores)
    for c in stores:
        c._flush()
    sizes = [_rows(c) for c in stores]
    idx = max(c._idx for c in stores)
    pads = [idx - c._idx for c in stores]
    full = [c for c in stores if c._idx]
    written = min((c._written + p for c, p in zip(stores, pads) if c._idx), default=idx)
    # a sequence's first tokens that its store holds in the first span only
    # are zeros in the batch's pages (a batch's pages hold every row but
    # those a window dropped; attention reads the first span instead)
    dropped = min(
        (
            c.dropped + p - (0 if c.window is not None else c._first_skip())
            for c, p in zip(stores, pads)
            if c._written
        ),
        default=0,
    )
    left = [
        c.left_padding + p if isinstance(c.left_padding, mx.array) else mx.array([p])
        for c, p in zip(stores, pads)
    ]
    batch.transform = Transform.joined([c.transform for c in stores], sizes)
    batch.spans.first_keys, batch.spans.first_values = _joined_first(stores, sizes)
    dtype = _held_dtype(full)
    held = [c._held_rows(idx - written, p, dtype) for c, p in zip(stores, pads)]
    pages = [c._page_rows(dropped, written, p) for c, p in zip(stores, pads)]
    like = None
    if written > dropped:
        source = next((c for c in full if c._written > c.dropped), None)
        if source is not None:
            like = source._encoded()
        else:
            # every store holds its rows in the first span only: zeros
            source = next(c for c in full if c.spans.first_keys is not None)
            like = (
                batch.key_codec.empty_page(source.spans.first_keys, 1),
                batch.value_codec.empty_page(source.spans.first_values, 1),
            )
    batch.left_padding = mx.concatenate(left)
    batch.offset = mx.concatenate(
        [
            mx.array([c.offset]) if isinstance(c.offset, int) else c.offset
            for c in stores
        ]
    )
    batch._idx, batch._written, batch.dropped = idx, written, dropped
    batch.key_pages, batch.value_pages = [], []
    batch.spans.n_held = 0
    batch.spans.held_keys = batch.spans.held_values = None
    if like is not None:
        parts = [_filled(r, like, n, written - dropped) for r, n in zip(pages, sizes)]
        batch.key_pages, batch.value_pages = (
            [tuple(mx.concatenate(x, axis=0) for x in zip(*part))]
            for part in zip(*parts)
        )
    if idx > written:
        like = next(h for h in held if h is not None)
        keys, values = zip(
            *(_filled_held(h, like, n, idx - written) for h, n in zip(held, sizes))
        )
        batch.spans.held_keys = mx.concatenate(keys)
        batch.spans.held_values = mx.concatenate(values)
        batch.spans.n_held = idx - written


def _held_dtype(stores):
    """The dtype held tokens are kept in: a store's held ones', else its first
    tokens', else its pages' last part's where it is a float (the model's
    for affine pages with float offsets)."""
    for c in stores:
        if c.spans.n_held:
            return c.spans.held_keys.dtype
    for c in stores:
        if c.spans.first_keys is not None:
            return c.spans.first_keys.dtype
    for c in stores:
        if c._written > c.dropped:
            dtype = c.key_pages[0][-1].dtype
            if mx.issubdtype(dtype, mx.floating):
                return dtype
    return mx.float32


def _filled(rows, like, n, size):
    """Page parts of ``size`` rows for ``n`` sequences: ``rows`` (key parts,
    value parts, first row) placed in zeros shaped like ``like`` (a store's
    key and value parts)."""
    out = []
    for i, parts in enumerate(like):
        filled = []
        for j, x in enumerate(parts):
            page = mx.zeros((n, x.shape[1], size, x.shape[3]), x.dtype)
            if rows is not None:
                source = rows[i][j]
                page[:, :, rows[2] : rows[2] + source.shape[2]] = source
            filled.append(page)
        out.append(tuple(filled))
    return out


def _filled_held(held, like, n, count):
    """``count`` held rows of keys and values (shaped and typed as ``like``'s)
    for ``n`` sequences: ``held`` right-justified (zeros before a sequence's
    first token), or zeros."""
    if held is None:
        return tuple(
            mx.zeros((n, x.shape[1], count, x.shape[3]), x.dtype) for x in like
        )
    pad = [(0, 0), (0, 0), (count - held[0].shape[2], 0), (0, 0)]
    return tuple(mx.pad(x, pad) for x in held)


def _roll(x, shift):
    """Rows of each sequence rolled right by its ``shift`` (B, 1)."""
    n = x.shape[2]
    index = (mx.arange(n)[None] - shift) % n
    index = mx.broadcast_to(index[:, None, :, None], x.shape[:3] + (1,))
    return mx.take_along_axis(x, mx.broadcast_to(index, x.shape), axis=2)


def _check_batchable(caches):
    settings = [c._batch_settings() for c in caches]
    if any(s != settings[0] for s in settings):
        raise ValueError(f"Cannot batch KV stores with different settings: {settings}")


def _joined_first(stores, sizes):
    """The first spans of stores laid end to end (zeros where a store has
    none yet: its first tokens are written later, or it is empty)."""
    n = stores[0].spans.first
    parts = [(s.spans.first_keys, s.spans.first_values) for s in stores]
    like = next((p for p in parts if p[0] is not None), None)
    if not n or like is None:
        return None, None
    joined = []
    for i in range(2):
        rows = []
        for (keys, values), size in zip(parts, sizes):
            x = (keys, values)[i]
            if x is None:
                x = mx.zeros(
                    (size, like[i].shape[1], n, like[i].shape[3]), like[i].dtype
                )
            rows.append(x)
        joined.append(mx.concatenate(rows))
    return tuple(joined)
