"""Keys (and values) stored minus a per-head mean fixed at the first write.

Softmax does not change when the same constant is added to every score of a
query row. A cache that stores ``k - m`` instead of ``k``, with ``m`` one
vector per sequence and kv head, gives scores ``q . k - q . m``: the same
attention, except that the quantizer no longer spends its range on ``m``. On
the models we measured the per-head mean holds most of the keys' energy
(``energy_in_mean`` in docs/data/diagnostics-*.json). Values can be centered
too: the output ``sum_i p_i (v_i - m_v) + m_v`` is exact because the
probabilities sum to 1.

The mean is taken over the first update of an empty cache (per batch element,
its padding left out, and the first token left out when there are others: it
is often an attention sink with an outlier key), then frozen: every later
write subtracts the same vector, as it must. It is part of the cache's state,
so saving and loading keep it.

``CenteredQuantizedKVCache``, ``CenteredQuantizedRotatingKVCache`` and
``CenteredBatchQuantizedKVCache`` are mlx-lm's affine caches with
``center="k"`` (keys) or ``"kv"`` (keys and values);
``omlx_cache.codebook.CodebookKVCache`` takes the same ``center`` option.

The first write also sets the key weights of ``key_scale`` (single
sequences, affine and codebook caches): keys stored channel by channel
times a per-head weight from the queries that attend that write, queries
divided by it (``query_key_weights``, ``_KeyWeighting``).
"""

import mlx.core as mx
from mlx_lm.models.cache import (
    BatchQuantizedKVCache,
    KVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    register_cache_class,
)

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


def check_center(center) -> str:
    """``""`` (off), ``"k"`` or ``"kv"`` from a setting; True means ``"k"``."""
    return check_choice(center, "center", CENTERS, "k")


def check_key_scale(key_scale) -> str:
    """``""`` (off), ``"q"`` or ``"qk"`` from a setting; True means ``"qk"``."""
    return check_choice(key_scale, "key_scale", KEY_SCALES, "qk")


def check_center_state(center, key_mean, value_mean) -> str:
    """The checked ``center`` of a state's (center, key mean, value mean)."""
    center = check_center(center)
    if key_mean is not None and not center:
        raise ValueError("Cache state has a key mean but centering is off.")
    if (value_mean is not None) != (center == "kv" and key_mean is not None):
        raise ValueError(f"Cache state's value mean does not fit center={center!r}.")
    if value_mean is not None and value_mean.shape[:2] != key_mean.shape[:2]:
        raise ValueError("Cache state's key and value means differ in shape.")
    return center


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


def query_key_weights(keys, queries=None, start=None, stop=None, mode="qk"):
    """Per-channel key weights (B, n_kv_heads, 1, D) from a first write of
    (centered) ``keys`` (B, n_kv_heads, T, D) and the queries that attend
    it (B, n_q_heads, T, D; ones without). A key error ``e`` costs a query
    ``(q . e)^2``: with keys stored as ``a * k`` (errors about even over the
    channels after the rotation) and queries as ``q / a``, the expected cost
    ``sum_c E[q_c^2] / a_c^2 * sum_c a_c^2 E[k_c^2]`` is least for
    ``a_c = (E[q_c^2] / E[k_c^2]) ** 1/4`` (``mode="qk"``). The keys'
    energies drift as a sequence goes on (RoPE turns the slow channel pairs
    away from the first write's mean), so ``mode="q"`` takes them as even
    and the queries' alone, a little flatter: ``a_c = E[q_c^2] ** 1/5``
    (on a calibration text, docs/codebook-quality.md). Means over each
    sequence's tokens ``start`` to ``stop`` but the first (as
    ``first_write_mean``); the weights' geometric mean is 1, each within
    1/16 to 16."""
    B, n_kv_heads, T, D = keys.shape
    if queries is None:
        return mx.ones((B, n_kv_heads, 1, D), mx.float32)
    if queries.shape[2] != T:
        start = stop = None
    q = first_write_mean(queries.astype(mx.float32) ** 2, start, stop)
    q = q.reshape(B, n_kv_heads, -1, D).mean(axis=2, keepdims=True)
    q_floor = 1e-6 * (q.mean(axis=-1, keepdims=True) + 1e-30)
    if mode == "q":
        weights = (q + q_floor) ** 0.2
    else:
        energy = first_write_mean(keys.astype(mx.float32) ** 2, start, stop)
        floor = 1e-6 * (energy.mean(axis=-1, keepdims=True) + 1e-30)
        weights = ((q + q_floor) / (energy + floor)) ** 0.25
    weights = weights / mx.exp(mx.log(weights).mean(axis=-1, keepdims=True))
    return mx.clip(weights, 1 / 16, 16)


def _repeat_heads(x: mx.array, n_heads: int) -> mx.array:
    """(B, n_kv_heads, 1, D) to (B, n_heads, 1, D): each kv head's row for the
    query heads that share it."""
    return mx.repeat(x, n_heads // x.shape[1], axis=1)


class _Centering:
    """The means of a centered cache: estimated at the first write, subtracted
    from every write (``_center``), added back to the output (``_uncenter``);
    state and batch bookkeeping. ``center = ""`` turns it all off."""

    center = ""
    key_mean = None
    value_mean = None
    # end (in cache rows) of each sequence's tokens in a right-padded prompt
    _valid_stop = None

    def _set_center(self, center):
        self.center = check_center(center)
        self.key_mean = self.value_mean = None

    def _require_center(self, center):
        self._set_center(center)
        if not self.center:
            raise ValueError(
                f"{type(self).__name__} needs center='k' or 'kv', got {center!r} "
                "(the uncentered cache is the class without 'Centered')."
            )

    def _valid_range(self):
        """Each sequence's tokens in the next write: (start, stop) in its rows."""
        idx = getattr(self, "_idx", 0)
        left = getattr(self, "left_padding", None)
        start = None if left is None else left - idx
        stop = None if self._valid_stop is None else self._valid_stop - idx
        return start, stop

    def _center(self, keys, values):
        """``keys`` and ``values`` minus the means, which the first write sets."""
        if not self.center:
            return keys, values
        if self.key_mean is None:
            start, stop = self._valid_range()
            self.key_mean = first_write_mean(keys, start, stop)
            if self.center == "kv":
                self.value_mean = first_write_mean(values, start, stop)
            self._valid_stop = None
        keys = (keys - self.key_mean).astype(keys.dtype)
        if self.value_mean is not None:
            values = (values - self.value_mean).astype(values.dtype)
        return keys, values

    def _uncenter(self, out: mx.array) -> mx.array:
        """The attention output (B, n_q_heads, L, D) with the value mean back."""
        if self.value_mean is None:
            return out
        mean = _repeat_heads(self.value_mean, out.shape[1])
        return (out + mean).astype(out.dtype)

    def _center_sinks(self, queries, scale, sinks):
        """Sink logits shifted as the scores are: (B, n_q_heads, L), or None.
        Centered values need every probability on a key: no sinks."""
        if sinks is None or self.key_mean is None:
            return sinks
        if self.value_mean is not None:
            raise ValueError(
                "A cache with centered values cannot attend with attention "
                "sinks (the probabilities do not sum to 1); center keys only."
            )
        mean = _repeat_heads(self.key_mean, queries.shape[1])
        shift = scale * (queries.astype(mx.float32) * mean).sum(axis=-1)
        return sinks.astype(mx.float32)[:, None] - shift

    def _center_state(self):
        return self.center, self.key_mean, self.value_mean

    def _set_center_state(self, center, key_mean, value_mean):
        self.center = check_center_state(center, key_mean, value_mean)
        self.key_mean, self.value_mean = key_mean, value_mean

    @property
    def _means_nbytes(self):
        return sum(m.nbytes for m in (self.key_mean, self.value_mean) if m is not None)

    # batches: each sequence keeps its own means

    @staticmethod
    def _check_same_center(caches):
        centers = {c.center for c in caches}
        if len(centers) > 1:
            raise ValueError(
                f"Cannot batch caches centered differently: {sorted(centers)}"
            )

    def _means(self):
        return self.key_mean, self.value_mean

    @staticmethod
    def _joined_means(parts, sizes):
        """Means of sequences laid end to end: each part's (key, value) means,
        zeros (no centering) for the ``sizes[i]`` sequences of a part that has
        none yet."""
        joined = []
        for i in range(2):
            known = [p[i] for p in parts if p[i] is not None]
            if not known:
                joined.append(None)
                continue
            like = known[0]
            joined.append(
                mx.concatenate(
                    [
                        p[i] if p[i] is not None else mx.zeros((n, *like.shape[1:]))
                        for p, n in zip(parts, sizes)
                    ]
                )
            )
        return tuple(joined)

    def _filter_means(self, batch_indices):
        if self.key_mean is not None:
            self.key_mean = self.key_mean[batch_indices]
        if self.value_mean is not None:
            self.value_mean = self.value_mean[batch_indices]

    def _extract_means(self, idx, cache):
        cache.center = self.center
        cache.key_mean, cache.value_mean = (
            None if m is None else m[idx : idx + 1] for m in self._means()
        )
        return cache


class _KeyWeighting:
    """Keys stored channel by channel times ``key_weights`` and queries
    divided by them (``key_scale``, see ``query_key_weights``): every
    ``q . k`` is unchanged, but more of the quantizer's precision goes to the
    channels the queries weigh. The weights come from the first write's keys
    (centered) and the queries that attend it; before they are set (None),
    keys are stored as they come. Mixed with ``_Centering``."""

    key_scale = ""
    key_weights = None

    def _set_key_scale(self, key_scale, key_weights=None):
        self.key_scale = check_key_scale(key_scale)
        self.key_weights = key_weights

    def _set_key_weights(self, keys, queries=None, start=None, stop=None):
        """Set the weights from a first write's ``keys`` (as they came: the
        key mean, if any, is taken off here) and its ``queries`` (weights of
        ones without)."""
        keys = keys.astype(mx.float32)
        if self.key_mean is not None:
            keys = keys - self.key_mean
        self.key_weights = query_key_weights(
            keys, queries, start, stop, mode=self.key_scale
        )

    def _weighted(self, keys, values):
        if self.key_weights is not None:
            keys = (keys * self.key_weights).astype(keys.dtype)
        return keys, values

    def _scaled_queries(self, queries):
        if self.key_weights is None:
            return queries
        weights = _repeat_heads(self.key_weights, queries.shape[1])
        return (queries / weights).astype(queries.dtype)

    @property
    def _weights_nbytes(self):
        return 0 if self.key_weights is None else self.key_weights.nbytes

    @staticmethod
    def _joined_weights(parts, sizes):
        """Key weights of sequences laid end to end (ones for a part with
        none), or None when no part has any."""
        known = [w for w in parts if w is not None]
        if not known:
            return None
        like = known[0]
        return mx.concatenate(
            [
                w if w is not None else mx.ones((n, *like.shape[1:]), like.dtype)
                for w, n in zip(parts, sizes)
            ]
        )


class _Centered(_Centering, _KeyWeighting):
    """Centering and key weights for mlx-lm's affine caches: around their
    ``update_and_fetch``, ``_transform`` and ``scaled_dot_product_attention``;
    the state gets three more items (five with ``key_scale``).

    With ``key_scale`` the first write of an empty cache waits in
    ``_pending`` for the first attention call, whose queries (and with
    ``"qk"`` the write's centered keys) set ``key_weights``: until then
    nothing is stored, ``offset`` stays and ``update_and_fetch`` returns
    ``(None, None)``. Whatever reads the cache first (``state``, ``trim``,
    ``keys_and_values``, another write) stores it with weights of ones.
    Keys are weighted after centering and before rotation; kept
    (``keep_exact``) and held (``residual``) tokens are stored alike."""

    _pending = None

    def update_and_fetch(self, keys, values):
        if self.key_scale and self.key_weights is None and self.empty():
            self._check_head_dims(keys.shape[-1], values.shape[-1])
            self._pending = (keys, values)
            return None, None
        self._flush_first_write()
        return super().update_and_fetch(keys, values)

    def _flush_first_write(self, queries=None):
        """Store a held first write, its key weights set from ``queries``
        (ones without); what ``update_and_fetch`` returns for it, or None
        when none is held."""
        if self._pending is None:
            return None
        keys, values = self._pending
        self._pending = None
        self._center(keys, values)  # the means are those of this write
        self._set_key_weights(keys, queries)
        return super().update_and_fetch(keys, values)

    def _transform(self, keys, values):
        keys, values = self._weighted(*self._center(keys, values))
        return super()._transform(keys, values)

    def scaled_dot_product_attention(
        self, queries, keys, values, scale, mask, sinks=None
    ):
        if self._pending is not None:
            keys, values = self._flush_first_write(queries)
        out = super().scaled_dot_product_attention(
            self._scaled_queries(queries),
            keys,
            values,
            scale=scale,
            mask=mask,
            sinks=sinks,
        )
        return self._uncenter(out)

    def empty(self):
        return self._pending is None and super().empty()

    def keys_and_values(self):
        self._flush_first_write()
        return super().keys_and_values()

    def trim(self, n):
        self._flush_first_write()
        return super().trim(n)

    def _weights_state(self):
        # without key weights the state is as before they existed
        return (self.key_scale, self.key_weights) if self.key_scale else ()

    def _set_weights_state(self, key_scale="", key_weights=None):
        if key_weights is not None and (
            self.key_mean is None or key_weights.shape != self.key_mean.shape
        ):
            raise ValueError("Cache state's key weights do not fit its key mean.")
        self._set_key_scale(key_scale, key_weights)
        self._pending = None

    @property
    def state(self):
        self._flush_first_write()
        return (*super().state, *self._center_state(), *self._weights_state())

    @state.setter
    def state(self, v):
        # a weighted cache's state ends in (..., key_scale, key_weights),
        # others in the key and value means
        n = 5 if isinstance(v[-2], str) else 3
        super(_Centered, type(self)).state.fset(self, v[:-n])
        self._set_center_state(*v[-n:][:3])
        self._set_weights_state(*v[-n:][3:])

    @property
    def nbytes(self):
        return super().nbytes + self._means_nbytes + self._weights_nbytes


@register_cache_class
class CenteredQuantizedKVCache(_Centered, QuantizedKVCache):
    """``QuantizedKVCache`` storing keys (``center="k"``) or keys and values
    (``"kv"``) minus their per-head mean of the first write; ``key_scale``
    (``"q"``, ``"qk"``; True is ``"qk"``) also weighs the keys' channels by
    the first write's queries (``query_key_weights``; see ``_Centered``)."""

    def __init__(
        self,
        group_size=64,
        bits=8,
        reserve=None,
        rotate=False,
        center="k",
        keep_exact=0,
        residual=0,
        key_scale="",
    ):
        super().__init__(
            group_size,
            bits,
            reserve=reserve,
            rotate=rotate,
            keep_exact=keep_exact,
            residual=residual,
        )
        self._require_center(center)
        self._set_key_scale(key_scale)

    @classmethod
    def merge(cls, caches):
        if any(c.key_scale for c in caches):
            raise NotImplementedError(
                "Caches with weighted keys (key_scale) cannot be batched yet; "
                "serve them one sequence at a time."
            )
        return CenteredBatchQuantizedKVCache.merge(caches)


@register_cache_class
class CenteredQuantizedRotatingKVCache(_Centered, QuantizedRotatingKVCache):
    """``QuantizedRotatingKVCache`` with ``center`` and ``key_scale`` as
    ``CenteredQuantizedKVCache``."""

    def __init__(
        self,
        max_size,
        keep=0,
        group_size=64,
        bits=8,
        rotate=False,
        center="k",
        keep_exact=0,
        key_scale="",
    ):
        super().__init__(max_size, keep, group_size, bits, rotate, keep_exact)
        self._require_center(center)
        self._set_key_scale(key_scale)

    @classmethod
    def merge(cls, caches):
        raise NotImplementedError(
            "Centered rotating caches cannot be batched yet (no centered "
            "BatchQuantizedRotatingKVCache); serve them one sequence at a time."
        )


@register_cache_class
class CenteredBatchQuantizedKVCache(_Centered, BatchQuantizedKVCache):
    """``BatchQuantizedKVCache`` with ``center`` as ``CenteredQuantizedKVCache``;
    each sequence has its own means (zero, i.e. not centered, for a sequence
    whose first tokens came after the batch's first write)."""

    def __init__(
        self,
        left_padding,
        group_size=64,
        bits=8,
        rotate=False,
        center="k",
        keep_exact=0,
    ):
        super().__init__(left_padding, group_size, bits, rotate, keep_exact)
        self._require_center(center)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        super().prepare(
            left_padding=left_padding, lengths=lengths, right_padding=right_padding
        )
        if lengths is not None and self.key_mean is None:
            self._valid_stop = mx.array(lengths) + self._idx

    def filter(self, batch_indices):
        super().filter(batch_indices)
        self._filter_means(batch_indices)

    def extend(self, other):
        self._check_same_center([self, other])
        sizes = [c.offset.shape[0] for c in (self, other)]
        means = self._joined_means([self._means(), other._means()], sizes)
        super().extend(other)
        self.key_mean, self.value_mean = means

    def extract(self, idx):
        single = super().extract(idx)
        cache = CenteredQuantizedKVCache(**self._settings(), center=self.center)
        cache.key_pages, cache.value_pages = single.key_pages, single.value_pages
        cache.offset = single.offset
        cache.exact_keys, cache.exact_values = single.exact_keys, single.exact_values
        return self._extract_means(idx, cache)

    @classmethod
    def merge(cls, caches):
        cls._check_same_center(caches)
        batch = super().merge(caches)
        batch._set_center(caches[0].center)
        parts = [c._means() for c in caches]
        batch.key_mean, batch.value_mean = cls._joined_means(parts, [1] * len(caches))
        return batch


def centered(cache, center="k", key_scale=""):
    """The centered quantized form of an empty ``KVCache``,
    ``RotatingKVCache``, ``QuantizedKVCache`` or ``QuantizedRotatingKVCache``
    (quantized ones keep their settings; plain ones get 4-bit, group 64),
    its keys weighted by ``key_scale``."""
    if not cache.empty():
        raise ValueError("Only an empty cache can be made centered.")
    settings = {"group_size": 64, "bits": 4, "rotate": False}
    if isinstance(cache, (QuantizedKVCache, QuantizedRotatingKVCache)):
        settings = cache._settings()
    if type(cache) in (KVCache, QuantizedKVCache, CenteredQuantizedKVCache):
        residual = getattr(cache, "residual", 0)
        return CenteredQuantizedKVCache(
            **settings, center=center, residual=residual, key_scale=key_scale
        )
    if type(cache) in (
        RotatingKVCache,
        QuantizedRotatingKVCache,
        CenteredQuantizedRotatingKVCache,
    ):
        return CenteredQuantizedRotatingKVCache(
            cache.max_size, cache.keep, **settings, center=center, key_scale=key_scale
        )
    raise ValueError(f"No centered form of {type(cache).__name__}.")
