"""Centering and key weights: what a store does to keys and values before a
codec encodes them, fixed at the first write.

Softmax does not change when the same constant is added to every score of a
query row. A store that keeps ``k - m`` instead of ``k``, with ``m`` one
vector per sequence and KV head, gives scores ``q . k - q . m``: the same
attention, except that the quantizer no longer spends its range on ``m``.
Values can be centered too: the output ``sum_i p_i (v_i - m_v) + m_v`` is
exact because the probabilities sum to 1. The means are taken over the first
write of an empty store (per sequence, its padding left out, and the first
token left out when there are others: it is often an attention sink with an
outlier key), then frozen.

Key weights (``key_scale``): keys stored channel by channel times a
per-head weight from the queries that attend the first write, queries divided
by it (``query_key_weights``): every ``q . k`` is unchanged, but more of the
quantizer's precision goes to the channels the queries weigh.
"""

import mlx.core as mx

from .rotation import hadamard_matrix, rotate

CENTERS = ("k", "kv")
KEY_SCALES = ("q", "qk")


def check_choice(value, name: str, choices: tuple, default: str) -> str:
    """``""`` (off: None, False or ``""``), ``default`` (True) or one of
    ``choices`` from the setting ``name``, else ValueError."""
    if value is None or value is False or value == "":
        return ""
    if value is True:
        return default
    if value in choices:
        return value
    raise ValueError(
        f"{name} must be one of {choices}, True or off (None, False, ''), "
        f"got {value!r}."
    )


def first_write_mean(x: mx.array, start=None, stop=None) -> mx.array:
    """Float32 mean of ``x`` (B, n_kv_heads, T, D) over the tokens ``start`` to
    ``stop`` of each batch element (ints or (B,) arrays; default all), leaving
    out the first of them when there are more: shape (B, n_kv_heads, 1, D),
    zero for an element with no token in range."""
    B, _, T, _ = x.shape
    start = mx.broadcast_to(mx.array(0 if start is None else start), (B,))
    stop = mx.broadcast_to(mx.array(T if stop is None else stop), (B,))
    start, stop = mx.clip(start, 0, T), mx.clip(stop, 0, T)
    first = start + (stop - start > 1)
    pos = mx.arange(T)[None]
    weights = (pos >= first[:, None]) & (pos < stop[:, None])
    weights = weights.astype(mx.float32)[:, None, :, None]
    total = (x.astype(mx.float32) * weights).sum(axis=2, keepdims=True)
    return total / mx.maximum(weights.sum(axis=2, keepdims=True), 1)


def query_key_weights(keys, query_energy=None, mode="qk", stop=None):
    """Per-channel key weights (B, n_kv_heads, 1, D) from (centered) ``keys``
    (B, n_kv_heads, T, D; the first token left out when there are more) and
    the mean squared queries that attend them, per KV head (B, n_kv_heads,
    1, D; None: weights of ones). A key error ``e`` costs a query
    ``(q . e)^2``: with keys stored as ``a * k`` and queries as ``q / a``,
    the expected cost is least for ``a_c = (E[q_c^2] / E[k_c^2]) ** 1/4``
    (``mode="qk"``). ``mode="q"`` takes the keys' energies as even and the
    queries' alone, a little flatter: ``a_c = E[q_c^2] ** 1/5``. The
    weights' geometric mean is 1, each within 1/16 to 16."""
    B, n_kv_heads, _, D = keys.shape
    if query_energy is None:
        return mx.ones((B, n_kv_heads, 1, D), mx.float32)
    q = query_energy.astype(mx.float32)
    q_floor = 1e-6 * (q.mean(axis=-1, keepdims=True) + 1e-30)
    if mode == "q":
        weights = (q + q_floor) ** 0.2
    else:
        energy = first_write_mean(keys.astype(mx.float32) ** 2, stop=stop)
        floor = 1e-6 * (energy.mean(axis=-1, keepdims=True) + 1e-30)
        weights = ((q + q_floor) / (energy + floor)) ** 0.25
    weights = weights / mx.exp(mx.log(weights).mean(axis=-1, keepdims=True))
    return mx.clip(weights, 1 / 16, 16)


def _rows(parts, sizes, fill):
    """Per-sequence arrays laid end to end; ``fill(n, like)`` for the ``sizes[i]``
    sequences of a part that has none; None when no part has any."""
    known = [p for p in parts if p is not None]
    if not known:
        return None
    like = known[0]
    return mx.concatenate(
        [p if p is not None else fill(n, like) for p, n in zip(parts, sizes)]
    )


def _zeros(n, like):
    return mx.zeros((n, *like.shape[1:]), like.dtype)


def _ones(n, like):
    return mx.ones((n, *like.shape[1:]), like.dtype)


class Transform:
    """``center`` (``""``, ``"k"`` or ``"kv"``; True: ``"k"``) and ``key_scale``
    (``""``, ``"q"`` or ``"qk"``; True: ``"qk"``), with what the first write
    sets: ``key_mean``, ``value_mean`` and ``key_weights`` (B, n_kv_heads, 1,
    D), None until then."""

    def __init__(
        self, center="", key_scale="", key_mean=None, value_mean=None, key_weights=None
    ):
        self.center = check_choice(center, "center", CENTERS, "k")
        self.key_scale = check_choice(key_scale, "key_scale", KEY_SCALES, "qk")
        self.key_mean, self.value_mean = key_mean, value_mean
        self.key_weights = key_weights
        self._maps = {}
        if key_mean is not None and not self.center:
            raise ValueError("Cache state has a key mean but centering is off.")
        if (value_mean is not None) != (self.center == "kv" and key_mean is not None):
            raise ValueError(
                f"Cache state's value mean does not fit center={self.center!r}."
            )
        if key_weights is not None and not self.key_scale:
            raise ValueError("Cache state has key weights but key_scale is off.")

    @property
    def settings(self) -> dict:
        return {"center": self.center, "key_scale": self.key_scale}

    @property
    def on(self) -> bool:
        return bool(self.center or self.key_scale)

    @property
    def fixed(self) -> bool:
        """Whether what it does is known: set from the first tokens, or nothing."""
        return (not self.center or self.key_mean is not None) and (
            not self.key_scale or self.key_weights is not None
        )

    def fix(self, keys, values, query_energy=None, stop=None):
        """Set the means and weights from each sequence's first tokens ``keys``
        and ``values`` (B, n_kv_heads, n, D, as the model made them, the first
        ``stop`` of them (B,) written; the first, often an attention sink with
        an outlier key, left out) and the mean squared queries at those
        positions (``query_key_weights``)."""
        self._maps = {}
        if self.center:
            self.key_mean = first_write_mean(keys, stop=stop)
            if self.center == "kv":
                self.value_mean = first_write_mean(values, stop=stop)
        if self.key_scale:
            centered = keys.astype(mx.float32)
            if self.key_mean is not None:
                centered = centered - self.key_mean
            self.key_weights = query_key_weights(
                centered, query_energy, self.key_scale, stop
            )

    def __call__(self, keys, values):
        """Keys and values as the codecs encode them."""
        if self.key_mean is not None:
            keys = (keys - self.key_mean).astype(keys.dtype)
        if self.value_mean is not None:
            values = (values - self.value_mean).astype(values.dtype)
        if self.key_weights is not None:
            keys = (keys * self.key_weights).astype(keys.dtype)
        return keys, values

    def undo(self, keys, values):
        """Keys and values as the model made them from what ``__call__`` made."""
        if self.key_weights is not None:
            keys = keys / self.key_weights
        if self.key_mean is not None:
            keys = keys + self.key_mean
        if self.value_mean is not None:
            values = values + self.value_mean
        return keys, values

    def _map(self, part, dtype, dim):
        """``(matrix, shift)``: ``x @ matrix + shift`` is the keys ("k") or the
        values ("v") as ``__call__`` makes them, then rotated by the Hadamard
        matrix: one matmul a decode step. Made once per dtype."""
        key = (part, str(dtype))  # (a Dtype cannot be deep-copied)
        if key not in self._maps:
            matrix = hadamard_matrix(dim, mx.float32)
            weights, mean = self.key_weights, self.key_mean
            if part == "v":
                weights, mean = None, self.value_mean
            shift = None
            if mean is not None:
                if weights is not None:
                    mean = mean * weights
                shift = (-(mean @ matrix)).astype(dtype)
            if weights is not None:
                matrix = weights.swapaxes(-1, -2) * matrix
            self._maps[key] = (matrix.astype(dtype), shift)
        return self._maps[key]

    def rotated(self, keys, values):
        """Keys and values as ``__call__`` makes them, rotated by the Hadamard
        matrix: an op each."""
        out = []
        for part, x in (("k", keys), ("v", values)):
            if part == "v" and self.value_mean is None:
                out.append(rotate(x, "hadamard"))
                continue
            matrix, shift = self._map(part, x.dtype, x.shape[-1])
            out.append(x @ matrix if shift is None else mx.addmm(shift, x, matrix))
        return tuple(out)

    def query_scale(self, dtype, n_heads):
        """(B, n_heads, 1, D): what queries are multiplied by (the
        key weights' reciprocals, each KV head's for its query heads), or
        None."""
        if self.key_weights is None:
            return None
        key = ("q", str(dtype), n_heads)
        if key not in self._maps:
            weights = self.key_weights
            weights = mx.repeat(weights, n_heads // weights.shape[1], axis=1)
            # bfloat16's 8 bits would move every score: float32 there
            self._maps[key] = (1 / weights).astype(
                mx.float32 if dtype == mx.bfloat16 else dtype
            )
        return self._maps[key]

    def arrays(self):
        return self.key_mean, self.value_mean, self.key_weights

    @property
    def nbytes(self):
        return sum(x.nbytes for x in self.arrays() if x is not None)

    # batches: each sequence keeps its own means and weights

    def take(self, indices):
        self._maps = {}
        self.key_mean, self.value_mean, self.key_weights = (
            None if x is None else x[indices] for x in self.arrays()
        )

    @classmethod
    def joined(cls, transforms, sizes):
        """The transforms of sequences laid end to end (zero means, unit weights
        for sequences that have none yet)."""
        settings = {tuple(t.settings.items()) for t in transforms}
        if len(settings) > 1:
            raise ValueError(
                f"Cannot batch caches with different transforms: {sorted(settings)}"
            )
        parts = list(zip(*(t.arrays() for t in transforms)))
        return cls(
            **transforms[0].settings,
            key_mean=_rows(parts[0], sizes, _zeros),
            value_mean=_rows(parts[1], sizes, _zeros),
            key_weights=_rows(parts[2], sizes, _ones),
        )
