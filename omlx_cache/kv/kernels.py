"""Where backend kernels plug in: one registry for attention and encoding.

A kernel is an ``(applies, run)`` pair. Attention tries the registered
attention kernels in order (``applies(call)``, then ``run(call)``, which
may still return None to decline) before its MLX-ops loop, the reference on
every backend; a codec's ``encode`` asks ``encode`` first in the same way.
A kernel that attends held decode tokens says how many a store should hold
for it (``hold``). The kernels live in ``omlx_cache.kernels`` and register
themselves when it is imported, which happens here, once, at the first use.
Caches and codecs never import a kernel.
"""

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    name: str
    applies: Callable
    run: Callable
    # (keys, values, key_codec, value_codec) -> Hold or None: the decode
    # tokens a store holds unquantized for this kernel
    hold: Callable | None = None


@dataclass(frozen=True)
class Hold:
    """Decode tokens held unquantized for a kernel: up to ``size``, written to
    the pages when one more comes. ``rotated``: held in the codecs' rotated
    domain (else only centered and weighted). ``incoming``: the newest token
    is handed to the kernel as it came, which writes it into the buffer."""

    size: int
    rotated: bool = True
    incoming: bool = False


_attention: list[Kernel] = []
_encoders: list[Kernel] = []
_disabled = [frozenset()]
_loaded = []


def register_attention(kernel: Kernel):
    _attention[:] = [k for k in _attention if k.name != kernel.name] + [kernel]


def register_encoder(kernel: Kernel):
    _encoders[:] = [k for k in _encoders if k.name != kernel.name] + [kernel]


def _load():
    if not _loaded:
        _loaded.append(True)
        importlib.import_module("omlx_cache.kernels")


def _enabled(kernels):
    _load()
    return [
        k for k in kernels if k.name not in _disabled[-1] and "*" not in _disabled[-1]
    ]


def attention_kernels() -> list[Kernel]:
    return _enabled(_attention)


def encode(x, codec):
    """The first registered encoder's encoding of ``x``, or None."""
    for kernel in _enabled(_encoders):
        if kernel.applies(x, codec):
            return kernel.run(x, codec)
    return None


def hold(keys, values, key_codec, value_codec) -> Hold | None:
    """How many decode tokens to hold for the first kernel that wants them."""
    for kernel in attention_kernels():
        if kernel.hold is not None:
            held = kernel.hold(keys, values, key_codec, value_codec)
            if held is not None:
                return held
    return None


def names() -> list[str]:
    _load()
    return [k.name for k in _attention + _encoders]


@contextlib.contextmanager
def disabled(*names):
    """Within it the named kernels (all without names: the MLX-ops reference)
    are not used, and no decode tokens are held for them."""
    _disabled.append(_disabled[-1] | frozenset(names or ("*",)))
    try:
        yield
    finally:
        _disabled.pop()
