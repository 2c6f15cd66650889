"""Backend kernels for ``omlx_cache.kv``, registered here, in one place.

- ``affine-decode`` / ``affine-prefill``: CUDA attention over the pages of
  two ``Affine`` codecs (``affine_decode``, ``affine_prefill``).
- ``codebook`` / ``codebook-encode``: CUDA attention and encoding for
  ``Codebook`` codecs (``codebook``).

Each entry's ``applies(call)`` says whether it takes an attention call
(``kv.attention.Call``); ``run(call)`` returns the output, or None to leave
the call to the next entry and finally to the MLX-ops loop. A kernel that
attends held decode tokens says how many a store should hold (``hold``).
Imported by ``omlx_cache.kv.kernels`` at the first use.
"""

import mlx.core as mx

from ..kv.attention import shared
from ..kv.codecs import Affine
from ..kv.kernels import Hold, Kernel, register_attention, register_encoder
from ..kv.rotation import rotate
from . import affine_decode, affine_prefill
from . import codebook as codebook_kernel


def _affine(call) -> bool:
    """Whether a call's codecs are both affine and nothing bars the kernels:
    first tokens whose visibility the mask does not give. (Sinks: decode
    and the dequantized prefill take them, the fused prefill does not.)"""
    return (
        bool(call.key_pages)
        and _float_offsets(call.key_codec, call.value_codec)
        and (call.first is None or call.first.mask is None)
        and (call.recent is None or call.recent.rotated)
    )


def _float_offsets(*codecs) -> bool:
    """Whether the codecs are affine with float offsets, what the kernels
    read (integer offsets take the MLX-ops loop)."""
    return all(isinstance(c, Affine) and c.offset == "float" for c in codecs)


def _first(call):
    return None if call.first is None else tuple(call.first[:4])


def _held(call):
    recent = call.recent
    return None if recent is None else (recent.keys, recent.values, recent.count)


def _quantization(call):
    k, v = call.key_codec, call.value_codec
    return k.group_size, k.bits, v.group_size, v.bits


def _decode_applies(call) -> bool:
    if not _affine(call) or call.queries.shape[2] != 1:
        return False
    return affine_decode.applies(
        call.queries,
        call.mask,
        call.key_pages,
        call.value_pages,
        call.key_codec.bits,
        call.value_codec.bits,
        call.total,
    )


def first_tokens_visible(mask, length, count):
    """A decode mask array over the pages' ``length`` rows and the held ones
    with ``count`` visible columns between them: first tokens the pages do
    not hold, held ahead of the decode tokens (the query is after them)."""
    if mask is None or isinstance(mask, str):
        return mask
    while mask.ndim < 4:
        mask = mask[None]
    shape = (*mask.shape[:3], count)
    if mask.dtype == mx.bool_:
        visible = mx.ones(shape, mx.bool_)
    else:
        visible = mx.zeros(shape, mask.dtype)
    return mx.concatenate([mask[..., :length], visible, mask[..., length:]], axis=-1)


def _first_mask(call, n_held):
    """``affine_decode.first_tokens_mask`` for a call, made once a step."""
    first, B = call.first, call.queries.shape[0]
    args = (first.first, first.count, n_held, call.mask, call.length, B)
    if first.key is None:
        return affine_decode.first_tokens_mask(*args)
    key = ("affine-decode first", first.key, first.count, n_held, call.length, B)
    return shared(key, call.mask, affine_decode.first_tokens_mask, *args)


def _decode(call):
    held, mask, first = _held(call), call.mask, call.first
    if first is not None:
        count = first.count
        if not (isinstance(first.first, int) and first.first + count <= 0):
            # the pages hold copies of the first tokens: hidden
            mask = _first_mask(call, held[2] if held else 0)
        else:
            # the pages hold none of them: visible to the query, after them
            mask = first_tokens_visible(mask, call.length, count)
        first = (first.keys, first.values, count)
    out = affine_decode.quantized_decode_attention(
        call.rotated_queries(),
        call.key_pages,
        call.value_pages,
        call.scale,
        call.length,
        *_quantization(call),
        mask=mask,
        held=held,
        first=first,
        sinks=call.shifted_sinks(),
    )
    return call.finish(out)


def _affine_hold(keys, values, key_codec, value_codec):
    if not _float_offsets(key_codec, value_codec):
        return None
    if not affine_decode.takes_held_tokens(
        keys, values, key_codec.bits, value_codec.bits
    ):
        return None
    return Hold(32, rotated=True)


def _prefill_path(call):
    """The prefill kernel that takes this call, or None (sinks: the
    dequantized copies only)."""
    if not _affine(call) or call.queries.shape[2] == 1:
        return None
    args = (call.queries, call.mask, call.key_pages, call.value_pages)
    bits = (call.key_codec.bits, call.value_codec.bits)
    if affine_prefill.decodes(*args, bits[1], call.length, _first(call), _held(call)):
        return affine_prefill.decoded_attention
    if (
        call.first is None
        and call.recent is None
        and call.sinks is None
        and affine_prefill.applies(*args, *bits, call.length)
    ):
        return affine_prefill.quantized_prefill_attention
    return None


def _key_shift(call):
    """What centering took from the keys, as the copies hold them (rotated,
    weighted): added back where sinks are attended, since a sink's logit is
    against the keys as the model made them. None without centering."""
    if call.key_mean is None:
        return None
    mean = call.key_mean
    if call.key_weights is not None:
        mean = mean * call.key_weights
    return rotate(mean, call.key_codec.rotation).astype(call.queries.dtype)


def _prefill(call):
    prefill = _prefill_path(call)
    extra = {}
    if prefill is affine_prefill.decoded_attention:
        extra = {"exact": _first(call), "held": _held(call)}
        if call.sinks is not None:
            extra.update(sinks=call.sinks, key_shift=_key_shift(call))
    out = prefill(
        call.rotated_queries(),
        call.key_pages,
        call.value_pages,
        call.scale,
        call.length,
        *_quantization(call),
        mask=call.mask,
        **extra,
    )
    # A prefill chunk's layers are evaluated one by one, as the MLX-ops
    # loop's tiles are: a whole chunk's graph keeps many layers'
    # intermediates alive at once (gigabytes at 8B shapes).
    mx.eval(out)
    return call.finish(out)


def _codebook_applies(call) -> bool:
    first = call.first
    if first is not None and first.mask is not None:
        return False
    if (
        first is not None
        and call.queries.shape[2] == 1
        and isinstance(call.mask, mx.array)
        and isinstance(first.first, int)
        and first.first < 0
    ):
        # the decode kernel reads the first tokens' visibility from the mask
        # at their rows: none for a sequence's before the pages (a batch's
        # pages hold every row a window did not drop)
        return False
    return bool(call.key_pages)


def _codebook(call):
    decode = call.queries.shape[2] == 1
    recent = call.recent
    held = None
    if recent is not None:
        held = (recent.keys, recent.values, recent.count, recent.incoming)
    result = codebook_kernel.attention(
        call.queries if decode else call.weighted_queries(),
        call.key_pages,
        call.value_pages,
        call.key_codec,
        call.value_codec,
        call.scale,
        call.mask,
        call.sinks,
        call.length,
        held,
        _first(call),
        (call.key_mean, call.value_mean, call.key_weights),
    )
    if result is None:
        return None
    out, buffers = result
    if buffers is not None:
        call.held = buffers
    # the decode kernel weighs the queries and adds the value mean itself
    return out if decode else call.uncenter(out)


def _codebook_hold(keys, values, key_codec, value_codec):
    if not codebook_kernel.holds(keys, values, key_codec, value_codec):
        return None
    return Hold(32, rotated=False, incoming=True)


register_attention(Kernel("affine-decode", _decode_applies, _decode, _affine_hold))
register_attention(
    Kernel("affine-prefill", lambda call: _prefill_path(call) is not None, _prefill)
)
register_attention(Kernel("codebook", _codebook_applies, _codebook, _codebook_hold))
register_encoder(
    Kernel("codebook-encode", codebook_kernel.encodes, codebook_kernel.encode)
)
