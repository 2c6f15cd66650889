"""Blocks of a prompt cache as files: the format behind ``omlx_cache.disk_cache``.

A block holds a fixed number of consecutive tokens of every layer's cache (a
stored prefix's last block, its tail, may hold fewer). Its file is a
safetensors file: the block's tokens (``tokens``, int64), for every layer
``n`` the slices of the cache's own arrays for those tokens (``n.KIND.j``:
``n.keys.j`` and ``n.values.j``, the float keys and values of mlx-lm's
caches or the encoded pages of a ``KVStore``; ``n.held_keys.0`` and
``n.held_values.0``, a store's recent tokens held unquantized) and the arrays
among the cache's settings (``n.settings.j``, e.g. a store's first tokens and
means). The metadata holds ``format``, ``version``, ``key``, ``hash``,
``parent``, ``index``, ``tokens`` (the block size), ``layers`` (JSON: each
layer's cache class, layout, parts and settings) and ``crc32``, the CRC-32 of
the whole file taken with that field's value zeroed.

A block's ``hash`` is the SHA-256 of its parent's hash (the key's for the
first block) and its tokens as little-endian int64, so a file can be checked on
its own (``verify_block``) as well as against the chain it is read for. A block
that holds a store's held tokens is named ``<hash>.held.safetensors``: once a
longer prompt has them in its pages, its block (``<hash>.safetensors``) is
taken first, and the held one ages out.

Layouts say how a cache class's ``state`` maps to token slices and back, in
segments of rows: ``LinearLayout`` for ``KVCache`` (``keys, values,
offset``), ``RingLayout`` for ``RotatingKVCache`` while it holds every token
in order, ``StoreLayout`` for ``KVStore``: its pages' rows, then its held
ones. Restoring copies the blocks' slices into one array per part and
rebuilds the caches with ``from_state``: nothing is quantized again.
"""

import functools
import hashlib
import json
import math
import os
import re
import secrets
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from . import unified_memory
from .kv.rotation import rotate
from .kv.store import BatchKVStore, KVStore

FORMAT = "omlx-prefix-block"
# 2: five-bit codebook indices stored as low and high bits (codebook.split_5bit)
# 3: omlx_cache.kv's KVStore (pages, held tokens); parts named n.KIND.j
FORMAT_VERSION = 3
SUFFIX = ".safetensors"
# the name of a block with held tokens: <hash>.held.safetensors
HELD = ".held"
# the parts of held tokens
HELD_KINDS = frozenset({"held_keys", "held_values"})
CRC_FIELD = '"crc32":"{}"'
NO_CRC = "00000000"
# safetensors dtype: (mlx dtype, numpy dtype holding its bits)
DTYPES = {
    "F32": (mx.float32, np.float32),
    "F16": (mx.float16, np.float16),
    "BF16": (mx.bfloat16, np.uint16),
    "U32": (mx.uint32, np.uint32),
    "U16": (mx.uint16, np.uint16),
    "U8": (mx.uint8, np.uint8),
    "I64": (mx.int64, np.int64),
    "I32": (mx.int32, np.int32),
    "I8": (mx.int8, np.int8),
}
DTYPE_NAMES = {mx_dtype: name for name, (mx_dtype, _) in DTYPES.items()}
NUMPY_DTYPES = {name: np.dtype(np_dtype) for name, (_, np_dtype) in DTYPES.items()}
FILL_STREAMS = min(16, os.cpu_count() or 1)


class BadBlock(Exception):
    """A block file that does not read back as the block asked for."""


def chain_hash(parent: str, tokens) -> str:
    data = np.asarray(tokens, dtype="<i8").tobytes()
    return hashlib.sha256(bytes.fromhex(parent) + data).hexdigest()


# --- files ----------------------------------------------------------------------


def to_numpy(x: mx.array) -> tuple[str, np.ndarray]:
    """(safetensors dtype, a copy of the array's bits in numpy)."""
    name = DTYPE_NAMES.get(x.dtype)
    if name is None:
        raise ValueError(f"Cannot store arrays of {x.dtype}.")
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    return name, np.array(x, copy=True)


def to_mlx(dtype: str, x: np.ndarray) -> mx.array:
    out = mx.array(x)
    return out.view(mx.bfloat16) if dtype == "BF16" else out


def encode_header(tensors: dict, metadata: dict) -> bytes:
    """The safetensors header of ``tensors`` ({name: (dtype, array)}), its
    CRC field zeroed, padded to a multiple of 8 bytes."""
    header = {"__metadata__": {**metadata, "crc32": NO_CRC}}
    offset = 0
    for name, (dtype, array) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":"))
    return (text + " " * (-len(text) % 8)).encode()


def write_block(path: Path, tensors: dict, metadata: dict) -> int:
    """Write a block file: to a temporary name, fsynced, renamed, and the
    directory fsynced. Returns the file's size."""
    header = encode_header(tensors, metadata)
    prefix = len(header).to_bytes(8, "little")
    data = [memoryview(np.ascontiguousarray(a)).cast("B") for _, a in tensors.values()]
    crc = zlib.crc32(header, zlib.crc32(prefix))
    for part in data:
        crc = zlib.crc32(part, crc)
    header = header.replace(
        CRC_FIELD.format(NO_CRC).encode(), CRC_FIELD.format(f"{crc:08x}").encode(), 1
    )
    temp = path.with_name(f"{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in (prefix, header, *data):
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.rename(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    sync_directory(path.parent)
    return len(prefix) + len(header) + sum(part.nbytes for part in data)


def sync_directory(directory: Path):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _parse_header(data, size: int) -> tuple[int, dict, dict, bytes, str]:
    """(header length, tensor entries, metadata, header with its CRC field
    zeroed, stored CRC) of a block file of ``size`` bytes whose first bytes
    (its length field and header at least) are ``data``."""
    if size < 8:
        raise BadBlock(f"truncated ({size} bytes)")
    n = int.from_bytes(data[:8], "little")
    if n > size - 8 or n > len(data) - 8:
        raise BadBlock("truncated (header)")
    raw = bytes(data[8 : 8 + n])
    try:
        header = json.loads(raw)
        metadata = header.pop("__metadata__")
        crc = metadata["crc32"]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise BadBlock("not a block file (bad header)") from None
    if not (isinstance(crc, str) and re.fullmatch(r"[0-9a-f]{8}", crc)):
        raise BadBlock("not a block file (no CRC)")
    zeroed = raw.replace(
        CRC_FIELD.format(crc).encode(), CRC_FIELD.format(NO_CRC).encode(), 1
    )
    return n, header, metadata, zeroed, crc


def tensor_layout(entries: dict) -> tuple:
    """((name, dtype, shape, start, stop), ...) of a header's tensors, which
    must lie one after the other from the data's first byte."""
    layout, end = [], 0
    try:
        for name, info in entries.items():
            dtype, shape, (start, stop) = (
                info["dtype"],
                tuple(info["shape"]),
                info["data_offsets"],
            )
            if not all(type(d) is int and d >= 0 for d in shape):
                raise ValueError
            size = math.prod(shape) * NUMPY_DTYPES[dtype].itemsize
            if start != end or stop - start != size:
                raise ValueError
            layout.append((name, dtype, shape, start, stop))
            end = stop
    except (ValueError, KeyError, TypeError):
        raise BadBlock("bad tensor layout") from None
    return tuple(layout)


def data_bytes(layout: tuple) -> int:
    return layout[-1][4] if layout else 0


def tensor_views(data, offset: int, layout: tuple, names=None) -> dict:
    """{name: (dtype, numpy array)} viewing ``data`` (the tensors of ``names``
    only, if given)."""
    tensors = {}
    for name, dtype, shape, start, _ in layout:
        if names is None or name in names:
            np_dtype = NUMPY_DTYPES[dtype]
            array = np.frombuffer(
                data, np_dtype, math.prod(shape), offset=offset + start
            )
            tensors[name] = (dtype, array.reshape(shape))
    return tensors


def _check_crc(crc: str, prefix, zeroed: bytes, data):
    """BadBlock unless the file's length field, header (its CRC field zeroed)
    and data have the stored CRC."""
    found = zlib.crc32(data, zlib.crc32(zeroed, zlib.crc32(prefix)))
    if f"{found:08x}" != crc:
        raise BadBlock("CRC mismatch (corrupt or truncated)")


def read_block(path: Path) -> tuple[dict, dict, int]:
    """(metadata, {name: (dtype, numpy array)}, file size) of a block file
    whose CRC and tensor layout check out, else BadBlock. The arrays view the
    file's bytes. A missing file raises FileNotFoundError."""
    try:
        data = memoryview(path.read_bytes())
    except FileNotFoundError:
        raise
    except OSError as e:
        raise BadBlock(f"cannot read it ({e.strerror})") from None
    n, entries, metadata, zeroed, crc = _parse_header(data, len(data))
    _check_crc(crc, data[:8], zeroed, data[8 + n :])
    layout = tensor_layout(entries)
    if 8 + n + data_bytes(layout) != len(data):
        raise BadBlock("size does not match its tensors")
    return metadata, tensor_views(data, 8 + n, layout), len(data)


def read_block_into(path: Path, slot: memoryview, layout: tuple, names) -> tuple:
    """``read_block`` of a file whose data (the bytes after its header) goes
    straight into ``slot``, if its tensors lie as ``layout`` says: (metadata,
    its tensors of ``names`` viewing ``slot``, file size), or None for another
    layout (``slot`` untouched)."""
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            n = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
            head = prefix + f.read(min(n, max(size - 8, 0)))
            n, entries, metadata, zeroed, crc = _parse_header(head, size)
            if tensor_layout(entries) != layout:
                return None
            if size - 8 - n != len(slot):
                raise BadBlock("size does not match its tensors")
            got = 0
            while got < len(slot) and (count := f.readinto(slot[got:])):
                got += count
    except FileNotFoundError:
        raise
    except OSError as e:
        raise BadBlock(f"cannot read it ({e.strerror})") from None
    if got != len(slot):
        raise BadBlock("truncated (data)")
    _check_crc(crc, prefix, zeroed, slot)
    return metadata, tensor_views(slot, 0, layout, names), size


def block_name(block_hash: str, held: bool = False) -> str:
    """The file name of a block (``held``: one with held tokens)."""
    return block_hash + (HELD if held else "") + SUFFIX


def name_hash(path: Path) -> tuple[str, bool]:
    """(hash, whether it is named as a block with held tokens) of a block file."""
    stem = path.name.removesuffix(SUFFIX)
    return stem.removesuffix(HELD), stem.endswith(HELD)


def holds_held(names) -> bool:
    """Whether tensors of these names hold held tokens (``n.held_*.j``)."""
    return any(
        name.count(".") == 2 and name.split(".")[1] in HELD_KINDS for name in names
    )


def check_block(
    path: Path, metadata: dict, tensors: dict, key: str, parent, index, held=None
):
    """The metadata of a block read from ``path`` checked: the format, the
    key, the hash (the file's name, and the hash of the parent and the stored
    tokens), whether the name says it holds held tokens as it does (``held``,
    else read off ``tensors``' names) and, when given, the parent and the
    index in the chain."""
    expected = {"format": FORMAT, "version": str(FORMAT_VERSION), "key": key}
    expected["hash"], named_held = name_hash(path)
    if parent is not None:
        expected["parent"] = parent
    if index is not None:
        expected["index"] = str(index)
    for name, value in expected.items():
        if metadata.get(name) != value:
            raise BadBlock(f"not this cache's block ({name} differs)")
    stored = tensors.get("tokens")
    if stored is None or stored[0] != "I64" or stored[1].ndim != 1:
        raise BadBlock("no tokens")
    if chain_hash(metadata.get("parent", ""), stored[1]) != expected["hash"]:
        raise BadBlock("its hash does not match its tokens")
    if held is None:
        held = holds_held(tensors)
    if held != named_held:
        raise BadBlock("its name does not say whether it holds held tokens")


def verify_block(path: Path, key: str, parent: str | None = None, index=None):
    """``read_block``, and the metadata checked (``check_block``)."""
    metadata, tensors, size = read_block(path)
    check_block(path, metadata, tensors, key, parent, index)
    return metadata, tensors, size


# --- layouts --------------------------------------------------------------------


def _parts(x) -> list[tuple]:
    """Keys (or values) of a state as pages of parts: an array is one page of
    one part, a tuple of arrays one page, a list of such tuples pages."""
    if isinstance(x, mx.array):
        return [(x,)]
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], mx.array):
        return [tuple(x)]
    return [tuple(page) for page in x]


def token_slice(pages: list[tuple], start: int, stop: int) -> tuple:
    """Tokens ``start:stop`` (axis -2) of ``pages``, one array per part; only
    the pages they lie in are read."""
    pieces, page_start = [], 0
    for page in pages:
        page_stop = page_start + page[0].shape[-2]
        lo, hi = max(start, page_start), min(stop, page_stop)
        if lo < hi:
            pieces.append(
                tuple(x[..., lo - page_start : hi - page_start, :] for x in page)
            )
        page_start = page_stop
    if len(pieces) == 1:
        return tuple(mx.contiguous(x) for x in pieces[0])
    return tuple(mx.concatenate(xs, axis=-2) for xs in zip(*pieces))


def describe_settings(settings: list) -> tuple[list, list]:
    """(JSON-able settings with arrays as {"array": i}, the arrays)."""
    arrays = []

    def walk(x):
        if isinstance(x, mx.array):
            arrays.append(x)
            return {"array": len(arrays) - 1}
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise ValueError(f"cannot store a cache setting of type {type(x).__name__}")

    return [walk(s) for s in settings], arrays


def restore_settings(described: list, arrays: list) -> list:
    def walk(x):
        if isinstance(x, dict):
            return arrays[x["array"]]
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return [walk(s) for s in described]


@dataclass
class Segment:
    """Rows ``start:stop`` of a layer, as pages of parts for each kind
    (``{"keys": pages, "values": pages}``)."""

    start: int
    stop: int
    kinds: dict


@dataclass
class LayerState:
    """What the blocks store of one layer's cache: its rows in segments (in
    the order of its layout's ``segments``), the arrays each kind has per page
    (``parts``), and its settings."""

    cls: type
    layout: "LinearLayout | StoreLayout"
    segments: list
    parts: dict  # kind: arrays per page
    plain: bool  # the state holds keys and values as arrays, not tuples
    settings: list  # JSON-able, arrays as {"array": i}
    arrays: list

    def describe(self) -> dict:
        return {
            "class": self.cls.__name__,
            "layout": self.layout.name,
            "parts": self.parts,
            "plain": self.plain,
            "settings": self.settings,
        }

    def slices(self, start: int, stop: int) -> dict:
        """{kind: one array per part} of rows ``start:stop``."""
        out = {}
        for s in self.segments:
            lo, hi = max(start, s.start), min(stop, s.stop)
            if lo < hi:
                for kind, pages in s.kinds.items():
                    out[kind] = token_slice(pages, lo - s.start, hi - s.start)
        return out

    def held(self, start: int, stop: int) -> bool:
        """Whether rows ``start:stop`` include held ones."""
        return any(
            max(start, s.start) < min(stop, s.stop) and HELD_KINDS & s.kinds.keys()
            for s in self.segments
        )


class LinearLayout:
    """Caches whose state is ``(keys, values, offset, *settings)``, token ``i``
    at index ``i`` of axis -2 (``KVCache``)."""

    name = "linear"
    segments = (("keys", "values"),)

    def length(self, cache) -> int:
        """Tokens held in order from the first (0: none usable)."""
        if cache.empty():
            return 0
        return int(cache.state[2])

    def settings(self, state) -> list:
        return list(state[3:])

    def split(self, cache) -> LayerState:
        state = cache.state
        settings, arrays = describe_settings(self.settings(state))
        keys, values = _parts(state[0]), _parts(state[1])
        plain = isinstance(state[0], mx.array)
        segment = Segment(0, self.length(cache), {"keys": keys, "values": values})
        parts = {"keys": len(keys[0]), "values": len(values[0])}
        return LayerState(type(cache), self, [segment], parts, plain, settings, arrays)

    def build(self, cls, parts: dict, length: int, settings: list, plain: bool):
        keys, values = parts["keys"], parts["values"]
        if plain:
            keys, values = keys[0], values[0]
        return self.from_state(cls, keys, values, length, settings)

    def from_state(self, cls, keys, values, length, settings):
        return cls.from_state([keys, values, length, *settings])


class RingLayout(LinearLayout):
    """Rotating caches, state ``(keys, values, offset, keep, max_size, idx,
    *settings)``: usable while they hold every token in order (``idx ==
    offset``, the window not yet wrapped)."""

    name = "ring"

    def length(self, cache) -> int:
        if cache.empty():
            return 0
        state = cache.state
        offset, idx = int(state[2]), int(state[5])
        return offset if idx == offset else 0

    def settings(self, state) -> list:
        settings = list(state[3:])
        settings[2] = None  # the ring index: the restored length
        return settings

    def from_state(self, cls, keys, values, length, settings):
        keep, max_size, _, *rest = settings
        return cls.from_state([keys, values, length, keep, max_size, length, *rest])


class StoreLayout:
    """``KVStore``: rows ``0:written`` are the pages' (encoded, kept so: never
    quantized again), rows ``written:idx`` the held ones (a residual's, or a
    kernel's decode tokens), unquantized in the codecs' rotated domains. The
    first tokens kept unquantized, the transform's arrays and the settings
    (JSON) are the layer's settings. A store's pages begin after its first
    tokens (they are in the first span only): their rows are stored encoded
    from the first span, so that the pages' rows run from row 0 as in blocks
    of every version, and restored stores leave them out again (never read).
    A store whose window dropped rows (pages, or a sliding window's first
    span) has no prefix from its first token: nothing to store (length 0)."""

    name = "store"
    segments = (("keys", "values"), ("held_keys", "held_values"))

    def length(self, store) -> int:
        if store.empty():
            return 0
        _, idx, _, _, _ = _rows(store.state)
        return 0 if store._window_dropped() else idx

    def split(self, store) -> LayerState:
        state = store.state
        key_pages, value_pages = state[:2]
        first_keys, first_values, held_keys, held_values = state[2:6]
        _, idx, written, dropped, n_held = _rows(state)
        if store._window_dropped():
            raise ValueError("KV stores whose window dropped rows")
        if dropped:
            # the first tokens the pages skip, as pages would hold them
            rows = (first_keys[:, :, :dropped], first_values[:, :, :dropped])
            key_pages = [store.key_codec.encode(rows[0], True), *key_pages]
            value_pages = [store.value_codec.encode(rows[1], True), *value_pages]
        segments = [
            Segment(0, written, {"keys": key_pages, "values": value_pages}),
        ]
        if n_held:
            held_keys, held_values = (
                x[:, :, :n_held] for x in (held_keys, held_values)
            )
            if not store.spans.rotated:
                # a kernel's buffer: restored stores hold theirs rotated
                held_keys = rotate(held_keys, store.key_codec.rotation)
                held_values = rotate(held_values, store.value_codec.rotation)
            segments.append(
                Segment(
                    written,
                    idx,
                    {"held_keys": [(held_keys,)], "held_values": [(held_values,)]},
                )
            )
        settings = [first_keys, first_values, *state[6:9], state[14]]
        settings, arrays = describe_settings(settings)
        parts = {
            "keys": store.key_codec.parts,
            "values": store.value_codec.parts,
            "held_keys": 1,
            "held_values": 1,
        }
        return LayerState(type(store), self, segments, parts, False, settings, arrays)

    def build(self, cls, parts: dict, length: int, settings: list, plain: bool):
        first_keys, first_values, key_mean, value_mean, key_weights, text = settings
        described = json.loads(text)
        page_size = int(described["page_size"])
        keys, values = parts.get("keys"), parts.get("values")
        written = keys[0].shape[-2] if keys else 0
        # the pages begin after the first tokens (in the first span only)
        dropped = min(int(described["first"]), written)
        if dropped:
            keys, values = (
                tuple(x[..., dropped:, :] for x in p) for p in (keys, values)
            )
        held_keys, held_values = (
            parts[kind][0] if kind in parts else None
            for kind in ("held_keys", "held_values")
        )
        state = (
            _paged(keys, page_size),
            _paged(values, page_size),
            first_keys,
            first_values,
            held_keys,
            held_values,
            key_mean,
            value_mean,
            key_weights,
            length,
            length,
            written,
            dropped,
            length - written,
            text,
        )
        return cls.from_state(state)


def _rows(state) -> list:
    """(offset, idx, written, dropped, n_held) of a ``KVStore`` state."""
    return [int(x) for x in state[9:14]]


def _paged(parts, page_size: int) -> list:
    """Rows (one array per part) as a store's pages of ``page_size`` rows,
    the last one padded with zero rows (as a store allocates them: attention
    tiles follow the pages)."""
    if not parts:
        return []
    n = parts[0].shape[-2]
    pages = []
    for start in range(0, n, page_size):
        page = tuple(x[..., start : start + page_size, :] for x in parts)
        short = page_size - page[0].shape[-2]
        if short:
            pad = [(0, 0)] * (page[0].ndim - 2) + [(0, short), (0, 0)]
            page = tuple(mx.pad(x, pad) for x in page)
        pages.append(page)
    return pages


LAYOUTS = {
    KVCache: LinearLayout(),
    RotatingKVCache: RingLayout(),
    KVStore: StoreLayout(),
    # a batch is never a prompt's cache
    BatchKVStore: None,
}


def layout_of(cls):
    """The layout of a cache class (listed in ``LAYOUTS``: a subclass may hold
    another state), or None."""
    return LAYOUTS.get(cls)


def cache_class(name: str):
    """The class of that name among those with a layout (never an import
    named by a file), or None."""
    for cls, layout in LAYOUTS.items():
        if layout is not None and cls.__name__ == name:
            return cls
    return None


def block_tensors(layers: list, tokens, start: int, stop: int) -> dict:
    """The tensors of the block of tokens ``start:stop`` ({name: (dtype,
    numpy array)}), evaluated in the calling thread."""
    slices = {}
    for n, layer in enumerate(layers):
        for kind, parts in layer.slices(start, stop).items():
            for j, x in enumerate(parts):
                slices[f"{n}.{kind}.{j}"] = x
        for j, x in enumerate(layer.arrays):
            slices[f"{n}.settings.{j}"] = x
    mx.eval(list(slices.values()))
    tensors = {"tokens": ("I64", np.asarray(tokens[start:stop], dtype=np.int64))}
    tensors.update((name, to_numpy(x)) for name, x in slices.items())
    return tensors


def _span(rows: tuple) -> tuple[int, int]:
    """(first, last) segment a layer's block has rows in."""
    filled = [i for i, n in enumerate(rows) if n]
    return (filled[0], filled[-1]) if filled else (len(rows), 0)


def follows(before: tuple, after: tuple) -> bool:
    """Whether a block whose layers have ``after`` rows in each segment can
    follow one with ``before``: no layer's rows go back to an earlier segment
    (a store's pages' rows after its held ones)."""
    return all(_span(b)[1] <= _span(a)[0] for b, a in zip(before, after))


class Plan:
    """Restoring a chain of blocks, and what every block must share with the
    first (classes and settings).

    The data of every full block of the first's tensor layout (its bytes after
    the header) is read straight into a row of host memory (``allocate``,
    ``slot``: MLX arrays, zeroed on CPU streams, written through numpy
    views); ``assemble`` then cuts each part out of the rows with a few MLX
    ops per part (on the GPU where there is one), so no Python runs per block
    and part. ``slot`` waits for ``allocate``, so blocks can be opened
    meanwhile. The blocks after those (a last, partial one; blocks whose
    layers split their rows otherwise between pages and held tokens) are read
    whole and joined after them."""

    def __init__(self, metadata: dict, tensors: dict):
        self.layers_text = metadata["layers"]
        self.described = json.loads(self.layers_text)
        self.layers = []  # (cls, layout, description, segments, settings)
        self.shapes = {}  # part name: (dtype, its shape but the tokens' axis)
        for n, d in enumerate(self.described):
            cls = cache_class(d["class"])
            layout = None if cls is None else layout_of(cls)
            if layout is None or layout.name != d["layout"]:
                raise BadBlock(f"unknown cache class {d['class']!r}")
            counts = d["parts"]
            if set(counts) != {kind for kinds in layout.segments for kind in kinds}:
                raise ValueError
            segments = [
                {
                    kind: [f"{n}.{kind}.{j}" for j in range(int(counts[kind]))]
                    for kind in kinds
                }
                for kinds in layout.segments
            ]
            settings, j = [], 0
            while f"{n}.settings.{j}" in tensors:
                settings.append(tensors[f"{n}.settings.{j}"])
                j += 1
            self.layers.append((cls, layout, d, segments, settings))
        self.first_rows = self.block_rows(tensors)
        self.held = holds_held(tensors)
        self.layout, offset = [], 0
        for name, (dtype, x) in tensors.items():
            self.layout.append((name, dtype, x.shape, offset, offset + x.nbytes))
            offset += x.nbytes
        self.layout = tuple(self.layout)
        self.offsets = {name: (a, b) for name, _, _, a, b in self.layout}
        self.parts = {
            name: (dtype, x.shape)
            for name, (dtype, x) in tensors.items()
            if name in self.shapes
        }
        self.small = {name for name in tensors if name not in self.parts}
        self.rows = []  # MLX uint8 arrays of (blocks, data bytes)
        self.views = []
        self.per_row_array = 1
        self._allocated = threading.Event()

    @classmethod
    def from_block(cls, metadata, tensors):
        """The plan from the chain's first block."""
        try:
            return cls(metadata, tensors)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise BadBlock(f"bad layer description ({type(e).__name__})") from None

    def block_rows(self, tensors: dict) -> tuple:
        """Each layer's rows in each segment of a block's ``tensors``; BadBlock
        unless the parts of a segment hold the same rows, all segments the
        block's tokens, and each part the dtype and shape (but the rows) it has
        in the blocks before."""
        count = len(tensors["tokens"][1])
        rows = []
        for n, (_, _, _, segments, _) in enumerate(self.layers):
            layer = []
            for kinds in segments:
                found = set()
                for names in kinds.values():
                    for name in names:
                        found.add(self._part_rows(tensors.get(name), name))
                if len(found) != 1:
                    raise BadBlock(f"layer {n}'s arrays do not hold the same tokens")
                layer.append(found.pop())
            if sum(layer) != count:
                raise BadBlock(f"layer {n}'s arrays do not hold {count} tokens")
            rows.append(tuple(layer))
        return tuple(rows)

    def _part_rows(self, part, name: str) -> int:
        if part is None:
            return 0
        dtype, x = part
        if x.ndim < 2:
            raise BadBlock(f"{name} has no tokens' axis")
        shape = (dtype, x.shape[:-2] + x.shape[-1:])
        if self.shapes.setdefault(name, shape) != shape:
            raise BadBlock("its arrays do not match the first block's")
        return x.shape[-2]

    def allocate(self, n_blocks: int):
        """Host memory for the data of ``n_blocks`` full blocks: zeroed by
        MLX on CPU streams (several, as first touching fresh memory is most of
        the cost), with numpy views to read into."""
        try:
            if n_blocks:
                streams = fill_streams()
                per = -(-n_blocks // len(streams))
                size = data_bytes(self.layout)
                for i, first in enumerate(range(0, n_blocks, per)):
                    shape = (min(per, n_blocks - first), size)
                    self.rows.append(mx.zeros(shape, mx.uint8, stream=streams[i]))
                mx.eval(self.rows)
                self.views = [np.asarray(x) for x in self.rows]
                self.per_row_array = per
        finally:
            self._allocated.set()

    def slot(self, i: int) -> memoryview:
        """Where full block ``i``'s data goes, once allocated."""
        self._allocated.wait()
        per = self.per_row_array
        if i // per >= len(self.views):
            raise RuntimeError("the memory of the restore was not allocated")
        return memoryview(self.views[i // per][i % per])

    def read(self, path: Path, i: int) -> tuple | None:
        """Full block ``i`` read into its slot (``read_block_into``): its
        metadata, tokens and settings, and size; None for a block of another
        tensor layout."""
        return read_block_into(path, self.slot(i), self.layout, self.small)

    def matches(self, metadata: dict, tensors: dict) -> bool:
        """Whether a later block has the first's classes and settings (a block
        of another sequence with other settings, e.g. a centered store's means,
        ends the chain without being a fault)."""
        text = metadata.get("layers")
        if text != self.layers_text:
            try:
                described = json.loads(text)
            except (TypeError, ValueError):
                raise BadBlock("bad layer description") from None
            if described != self.described:
                return False
        for n, (*_, settings) in enumerate(self.layers):
            for j, (dtype, x) in enumerate(settings):
                other = tensors.get(f"{n}.settings.{j}")
                if (
                    other is None
                    or other[0] != dtype
                    or not np.array_equal(other[1], x)
                ):
                    return False
        return True

    def assemble(self, n_blocks: int, others: list = ()) -> dict:
        """Every part's array ({name: MLX array}) of the first ``n_blocks``
        full blocks (read into slots), then of the blocks ``others`` (their
        tensors, read whole), in their stored types; the host rows are
        released. A part no block has is left out."""
        rows, left = [], n_blocks
        for x in self.rows:
            if left <= 0:
                break
            rows.append(x if x.shape[0] <= left else x[:left])
            left -= x.shape[0]
        # on CUDA the rows move to the GPU at once, not a page fault at a time
        unified_memory.prefetch_to_gpu(self.rows[: len(rows)])
        arrays = {}
        for name in self.shapes:
            pieces = []
            if name in self.parts:
                dtype, shape = self.parts[name]
                pieces = [self._cut(x, name, dtype, shape) for x in rows]
            pieces += [to_mlx(*t[name]) for t in others if name in t]
            if len(pieces) > 1:
                arrays[name] = mx.concatenate(pieces, axis=-2)
            elif pieces:
                arrays[name] = mx.contiguous(pieces[0])
        mx.eval(list(arrays.values()))
        self.rows, self.views = [], []
        return arrays

    def _cut(self, rows: mx.array, name: str, dtype: str, shape: tuple) -> mx.array:
        """A part's tokens in ``rows`` (blocks of data bytes), in order."""
        start, stop = self.offsets[name]
        n = rows.shape[0]
        x = rows[:, start:stop].view(DTYPES[dtype][0]).reshape(n, *shape)
        axis = len(shape) - 2  # the tokens' axis
        x = mx.moveaxis(x, 0, axis)
        return x.reshape(*shape[:axis], n * shape[axis], shape[-1])

    def build(self, arrays: dict, length: int) -> list:
        """The caches of ``length`` tokens from the parts' ``arrays``."""
        caches = []
        for cls, layout, d, segments, settings in self.layers:
            parts = {
                kind: tuple(arrays[name] for name in names)
                for kinds in segments
                for kind, names in kinds.items()
                if names and all(name in arrays for name in names)
            }
            settings = restore_settings(d["settings"], [to_mlx(*s) for s in settings])
            caches.append(layout.build(cls, parts, length, settings, d["plain"]))
        return caches


@functools.cache
def fill_streams() -> list:
    """CPU streams that zero a restore's arrays in parallel."""
    return [mx.new_stream(mx.cpu) for _ in range(FILL_STREAMS)]
