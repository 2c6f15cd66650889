"""Prompt caches on disk, behind mlx_lm.server's prompt cache in memory.

``mlx_lm.server --prompt-cache-dir DIR [--prompt-cache-disk-bytes N]`` finds
``DiskPromptCache`` as the entry point ``disk`` of the group
``mlx_lm.prompt_cache_tiers`` (the series' tier hook): the server's
``LRUPromptCache`` hands it every cache it stores and asks it for a longer
prefix than the memory holds.

A prompt's cache is stored in blocks of ``block_tokens`` tokens and a last,
partial block for the rest (its tail; ``omlx_cache.blocks`` has the file
format). A block's name is a hash chained over the key and every token up to
the block's end, so a block is found only after the very same tokens; a restore
walks the chain from the first block until one is missing, then takes the
longest tail stored there. With tails, a prefix comes back where it was stored
(e.g. at the end of a system prompt, where the server stores one), so the rest
of the prompt is computed as it would have been without the disk. The key
covers the model (its path, the hashes of its config files, its weight files'
names and sizes), the cache settings (``--kv-cache``, ``--kv-cache-config``,
``--kv-bits``, ``--kv-group-size``, ``--max-kv-size``,
``--quantized-kv-start``), the block size and the format version: a different
model or setting never reads another's blocks.

Caches stored: mlx-lm's ``KVCache`` and ``RotatingKVCache`` (until it wraps)
and omlx_cache.kv's ``KVStore`` (until a window drops pages), its pages as
they are and its held tokens (a residual's) unquantized: a restored prefix
attends as the cache that was stored. Prompts with other caches are not
stored (one warning line).

    DIR/<key>/key.json                    what the key stands for
    DIR/<key>/<hash>.safetensors          one block
    DIR/<key>/<hash>.held.safetensors     one block with a store's held tokens

Faults: a block is written to a temporary name, fsynced and renamed, so a
crash leaves no partial block under a block's name (the temporary files of
dead writers are removed at start). A block that does not read back (bad CRC,
truncated, another key's or other tokens, unknown layout) is skipped with one
warning line and removed; the restore keeps the blocks before it. A failed
write (disk full, file size limit, I/O error) stops writing with one warning
line; serving goes on.

Blocks are evicted least recently used first to keep the directory under the
byte cap. A chain is touched from its last block to its first, so it loses
its tail before its head.
"""

import argparse
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import queue
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from .blocks import (
    FORMAT,
    FORMAT_VERSION,
    HELD,
    SUFFIX,
    BadBlock,
    Plan,
    block_name,
    block_tensors,
    chain_hash,
    check_block,
    follows,
    layout_of,
    name_hash,
    verify_block,
    write_block,
)

BLOCK_TOKENS = 256
# the block size when the server builds the tier (tests use small blocks)
BLOCK_TOKENS_ENV = "OMLX_PROMPT_CACHE_BLOCK_TOKENS"
DEFAULT_MAX_BYTES = 10 << 30
# blocks converted for writing but not yet written: past this, insert waits
MAX_PENDING_BYTES = 1 << 30
HASH_NAME = re.compile(r"[0-9a-f]{64}(?:" + re.escape(HELD) + ")?" + re.escape(SUFFIX))
TEMP_NAME = re.compile(
    r"[0-9a-f]{64}(?:" + re.escape(HELD) + r")?\.(\d+)\.[0-9a-f]+\.tmp"
)
READ_THREADS = min(16, os.cpu_count() or 1)

log = logging.getLogger(__name__)


# --- keys -----------------------------------------------------------------------


def file_digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def path_identity(path) -> dict:
    """A model (or adapter) directory: its path, the hashes of its config
    files and the names and sizes of its weight files."""
    local = Path(path)
    if not local.exists():
        try:
            from mlx_lm.utils import hf_repo_to_path

            local = hf_repo_to_path(path)
        except (OSError, ValueError):
            return {"path": str(path)}
    local = local.resolve()
    return {
        "path": str(local),
        "configs": {p.name: file_digest(p) for p in sorted(local.glob("*config.json"))},
        "weights": {
            p.name: p.stat().st_size for p in sorted(local.glob("*.safetensors"))
        },
    }


def model_identity(model_key) -> list:
    """mlx_lm.server's model key (model, adapter and draft paths) as identities."""
    keys = model_key if isinstance(model_key, (tuple, list)) else (model_key,)
    return [None if k is None else path_identity(k) for k in keys]


def cache_settings(args: argparse.Namespace) -> dict:
    """The server's arguments that shape its caches."""
    names = (
        "kv_bits",
        "kv_group_size",
        "kv_cache",
        "kv_cache_config",
        "max_kv_size",
        "quantized_kv_start",
    )
    return {name: getattr(args, name, None) for name in names}


def chain_hashes(key: str, tokens, n_blocks: int, block_tokens: int) -> list:
    """The hashes of the first ``n_blocks`` blocks of ``tokens``."""
    hashes, h = [], key
    for i in range(n_blocks):
        h = chain_hash(h, tokens[i * block_tokens : (i + 1) * block_tokens])
        hashes.append(h)
    return hashes


@dataclass
class Namespace:
    """One key's directory."""

    key: str
    directory: Path

    def path(self, block_hash: str, held: bool = False) -> Path:
        return self.directory / block_name(block_hash, held)


@dataclass
class Stats:
    restores: int = 0
    restored_tokens: int = 0
    restored_bytes: int = 0
    restore_seconds: float = 0.0
    written_blocks: int = 0
    written_bytes: int = 0
    removed_bad: int = 0
    evicted: int = 0
    write_errors: list = field(default_factory=list)


class Timer:
    """Seconds per phase, summed over the threads that time it."""

    def __init__(self):
        self.seconds = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            with self._lock:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + spent


# --- the tier -------------------------------------------------------------------


class DiskPromptCache:
    """The disk tier of ``LRUPromptCache`` (``insert`` and ``fetch``; see the
    module's docstring). Blocks are sliced and copied in the caller's thread
    and written by one writer thread; ``flush`` waits for the writes."""

    def __init__(
        self,
        directory,
        max_bytes: int | None = None,
        settings: dict | None = None,
        block_tokens: int = BLOCK_TOKENS,
    ):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else int(max_bytes)
        self.settings = settings or {}
        self.block_tokens = block_tokens
        self.writable = True
        self.stats = Stats()
        self.last_restore = {}  # seconds of the last restore's phases
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._files = OrderedDict()  # block path -> bytes, least recent first
        self._bytes = 0
        self._namespaces = {}
        self._pending = set()  # block paths queued for writing
        self._pending_bytes = 0
        self._unsupported = set()
        self._jobs = queue.Queue()
        self._scan()
        self._writer = threading.Thread(
            target=self._write_loop, name="disk-prompt-cache", daemon=True
        )
        self._writer.start()
        log.info(
            f"disk prompt cache: {self.directory}, {len(self._files)} blocks "
            f"({self._bytes / 1e9:.2f} GB) of at most {self.max_bytes / 1e9:.2f} GB, "
            f"{block_tokens} tokens a block"
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace):
        """The entry point: the tier from mlx_lm.server's arguments."""
        block_tokens = int(os.environ.get(BLOCK_TOKENS_ENV, BLOCK_TOKENS))
        return cls(
            args.prompt_cache_dir,
            max_bytes=args.prompt_cache_disk_bytes,
            settings=cache_settings(args),
            block_tokens=block_tokens,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the block files under the directory (all keys)."""
        return self._bytes

    # --- index

    def _scan(self):
        """Index the block files, least recently used first; remove the
        temporary files of writers that are gone; evict down to the cap."""
        found = []
        for sub in self.directory.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                if HASH_NAME.fullmatch(f.name):
                    try:
                        st = f.stat()
                    except FileNotFoundError:
                        continue
                    found.append((st.st_mtime_ns, str(f), st.st_size))
                elif (m := TEMP_NAME.fullmatch(f.name)) and not alive(int(m[1])):
                    f.unlink(missing_ok=True)
        with self._lock:
            for _, name, size in sorted(found):
                self._files[Path(name)] = size
                self._bytes += size
            self._evict(0, ())

    def _namespace(self, model) -> Namespace:
        ns = self._namespaces.get(model)
        if ns is None:
            described = {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "block_tokens": self.block_tokens,
                "model": model_identity(model),
                "settings": self.settings,
            }
            text = json.dumps(described, sort_keys=True, default=list)
            key = hashlib.sha256(text.encode()).hexdigest()
            ns = Namespace(key, self.directory / key[:32])
            ns.directory.mkdir(exist_ok=True)
            info = ns.directory / "key.json"
            if not info.exists():
                temp = info.with_name(f"key.{os.getpid()}.json.tmp")
                temp.write_text(
                    json.dumps({"key": key, **described}, indent=1, default=list)
                )
                os.replace(temp, info)
            self._namespaces[model] = ns
        return ns

    def _touch(self, paths):
        """Mark ``paths`` used, the last one most recently."""
        now = time.time_ns()
        with self._lock:
            for i, path in enumerate(paths):
                if path in self._files:
                    self._files.move_to_end(path)
                    try:
                        os.utime(path, ns=(now + i, now + i))
                    except OSError:
                        pass

    def _forget(self, path: Path):
        with self._lock:
            size = self._files.pop(path, None)
            if size is not None:
                self._bytes -= size
        path.unlink(missing_ok=True)

    def _evict(self, incoming: int, keep) -> bool:
        """Remove least recently used blocks (none in ``keep``) until
        ``incoming`` more bytes fit under the cap; False if they cannot. The
        caller holds the lock."""
        for path in list(self._files):
            if self._bytes + incoming <= self.max_bytes:
                break
            if path in keep:
                continue
            self._bytes -= self._files.pop(path)
            path.unlink(missing_ok=True)
            self.stats.evicted += 1
        return self._bytes + incoming <= self.max_bytes

    # --- fetch

    def fetch(self, model, tokens, min_length: int = 0):
        """(caches of the longest stored prefix of ``tokens``, its length) if
        longer than ``min_length`` and shorter than ``tokens``, else None."""
        if len(tokens) - 1 <= min_length:
            return None
        try:
            ns = self._namespace(model)
            chain = self._stored_chain(ns, tokens)
        except (TypeError, ValueError, OverflowError, OSError):
            return None
        if sum(count for _, count in chain) <= min_length:
            return None
        start = time.perf_counter()
        restored = self._read_chain(ns, chain)
        if restored is None or restored[1] <= min_length:
            return None
        caches, length, n, nbytes = restored
        self._touch([path for path, _ in chain[:n]][::-1])
        seconds = time.perf_counter() - start
        s = self.stats
        s.restores += 1
        s.restored_tokens += length
        s.restored_bytes += nbytes
        s.restore_seconds += seconds
        log.info(
            f"disk prompt cache: restored {length} tokens ({n} blocks, "
            f"{nbytes / 1e6:.1f} MB) in {seconds:.3f} s"
        )
        return caches, length

    def _stored_chain(self, ns: Namespace, tokens) -> list:
        """[(path, tokens)] of the stored blocks that begin ``tokens`` (but
        leave at least one): full blocks, then the longest tail. A block with
        held tokens is taken where the one without is missing, and then only
        such blocks (a store's pages' rows never follow its held ones)."""
        B = self.block_tokens
        limit = len(tokens) - 1
        chain, parent, held = [], ns.key, False
        with self._lock:

            def find(block_hash):
                for with_held in (held, True):
                    path = ns.path(block_hash, with_held)
                    if path in self._files:
                        return path, with_held
                return None, held

            for h in chain_hashes(ns.key, tokens, limit // B, B):
                path, held = find(h)
                if path is None:
                    break
                chain.append((path, B))
                parent = h
            start = len(chain) * B
            for count in range(min(B - 1, limit - start), 0, -1):
                path, _ = find(chain_hash(parent, tokens[start : start + count]))
                if path is not None:
                    chain.append((path, count))
                    break
        return chain

    def _read_chain(self, ns: Namespace, chain: list):
        """(caches, tokens, blocks, bytes read) of the chain's first blocks
        that read back and follow each other, or None. The first is read alone
        (it sizes the restore); the other full blocks are read in parallel,
        straight into host memory, while it is allocated; a block of another
        tensor layout (a store's rows split otherwise between its pages and
        its held tokens) and the last, if partial, are read whole."""
        paths = [path for path, _ in chain]
        threading.Thread(target=read_ahead, args=(paths[1:],), daemon=True).start()

        def parent(i):
            return name_hash(paths[i - 1])[0] if i else ns.key

        def verify(i):
            return verify_block(paths[i], ns.key, parent(i), i)

        try:
            metadata, tensors, first_bytes = verify(0)
            plan = Plan.from_block(metadata, tensors)
        except FileNotFoundError:
            return None
        except BadBlock as e:
            self._bad(paths[0], e)
            return None
        full = sum(1 for _, count in chain if count == self.block_tokens)
        timer = Timer()

        def whole(i):
            """("whole", (tensors, rows), size) of block ``i`` read whole, or
            ("other", None, 0) for a block of other settings."""
            block_metadata, block_tensors, size = verify(i)
            if not plan.matches(block_metadata, block_tensors):
                return "other", None, 0
            return "whole", (block_tensors, plan.block_rows(block_tensors)), size

        def load(i):
            try:
                with timer("read"):
                    got = plan.read(paths[i], i)
                if got is None:  # another tensor layout
                    return whole(i)
                block_metadata, block_tensors, size = got
                with timer("check"):
                    check_block(
                        paths[i],
                        block_metadata,
                        block_tensors,
                        ns.key,
                        parent(i),
                        i,
                        held=plan.held,
                    )
                    if not plan.matches(block_metadata, block_tensors):
                        return "other", None, 0
                return "slot", plan.first_rows, size
            except FileNotFoundError:
                return "gone", None, 0
            except BadBlock as e:
                return "bad", e, 0

        n, nbytes, others, rows = 0, 0, [], None
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(READ_THREADS) as pool:
            loaded = pool.map(load, range(full))
            with timer("allocate"):
                plan.allocate(full)
            for i, (status, value, size) in enumerate(loaded):
                if status == "bad":
                    self._bad(paths[i], value)
                # blocks read whole go after those read into slots
                if status == "slot" and not others:
                    block_rows = value
                elif status == "whole":
                    whole_tensors, block_rows = value
                else:
                    break
                if rows is not None and not follows(rows, block_rows):
                    break
                if status == "whole":
                    others.append(whole_tensors)
                n, nbytes, rows = i + 1, nbytes + size, block_rows
        timer.seconds["blocks"] = time.perf_counter() - start
        if full == 0:  # the chain is one partial block
            n, nbytes, others = 1, first_bytes, [tensors]
        elif n == full < len(paths):
            tail, size = self._read_tail(paths[full], whole, full, rows)
            if tail is not None:
                n, nbytes = n + 1, nbytes + size
                others.append(tail)
        if n == 0:
            return None
        with timer("assemble"):
            arrays = plan.assemble(n - len(others), others)
        self.last_restore = timer.seconds
        length = sum(count for _, count in chain[:n])
        try:
            caches = plan.build(arrays, length)
        except (ValueError, TypeError, KeyError, IndexError) as e:
            log.warning(f"disk prompt cache: cannot restore from {paths[0]}: {e}")
            return None
        return caches, length, n, nbytes

    def _read_tail(self, path: Path, whole, i: int, rows):
        """(tensors, size) of the chain's last, partial block ``i`` if it
        reads back and follows the blocks before it (``rows``), else (None,
        0)."""
        try:
            status, value, size = whole(i)
            if status != "whole" or not follows(rows, value[1]):
                return None, 0
            return value[0], size
        except FileNotFoundError:
            return None, 0
        except BadBlock as e:
            self._bad(path, e)
            return None, 0

    def _bad(self, path: Path, error: BadBlock):
        log.warning(f"disk prompt cache: skipped and removed {path}: {error}")
        self.stats.removed_bad += 1
        self._forget(path)

    # --- insert

    def insert(self, model, tokens, prompt_cache):
        """Queue the blocks of ``tokens`` that the caches hold and the disk
        does not (full blocks and a tail) for writing; mark the chain used."""
        if not self.writable or not prompt_cache:
            return
        layouts = [layout_of(type(c)) for c in prompt_cache]
        if None in layouts:
            names = {
                type(c).__name__ for c, lay in zip(prompt_cache, layouts) if not lay
            }
            self._note_unsupported(f"caches of {', '.join(sorted(names))}")
            return
        B = self.block_tokens
        try:
            length = min(
                [len(tokens), *(lay.length(c) for lay, c in zip(layouts, prompt_cache))]
            )
            ns = self._namespace(model)
            hashes = chain_hashes(ns.key, tokens, length // B, B)
            if length % B:
                tail = tokens[len(hashes) * B : length]
                hashes.append(chain_hash(hashes[-1] if hashes else ns.key, tail))
        except (TypeError, ValueError, OverflowError, OSError):
            return
        if not hashes:
            return
        try:
            layers = [lay.split(c) for lay, c in zip(layouts, prompt_cache)]
        except ValueError as e:
            self._note_unsupported(str(e))
            return
        bounds = [(i * B, min((i + 1) * B, length)) for i in range(len(hashes))]
        held = [any(layer.held(*b) for layer in layers) for b in bounds]
        paths = [ns.path(h, with_held) for h, with_held in zip(hashes, held)]
        with self._lock:
            new = [i for i, p in enumerate(paths) if p not in self._files]
            new = [i for i in new if paths[i] not in self._pending]
            self._pending.update(paths[i] for i in new)
        for n, i in enumerate(new):
            if not self.writable:
                self._unqueue(paths[j] for j in new[n:])
                return
            tensors = block_tensors(layers, tokens, *bounds[i])
            metadata = {
                "format": FORMAT,
                "version": str(FORMAT_VERSION),
                "key": ns.key,
                "hash": hashes[i],
                "parent": hashes[i - 1] if i else ns.key,
                "index": str(i),
                "tokens": str(B),
                "layers": json.dumps([layer.describe() for layer in layers]),
            }
            size = sum(a.nbytes for _, a in tensors.values())
            with self._room:
                self._room.wait_for(lambda: self._pending_bytes < MAX_PENDING_BYTES)
                self._pending_bytes += size
            self._jobs.put(("write", paths[i], tensors, metadata, size, paths[:i]))
        self._jobs.put(("touch", paths[::-1]))

    def _unqueue(self, paths):
        with self._lock:
            self._pending.difference_update(paths)

    def _note_unsupported(self, what: str):
        if what not in self._unsupported:
            self._unsupported.add(what)
            log.warning(f"disk prompt cache: not storing {what}")

    # --- writing

    def _write_loop(self):
        while True:
            job = self._jobs.get()
            try:
                if job[0] == "write":
                    self._write(*job[1:])
                else:
                    self._touch(job[1])
            except Exception:
                log.exception("disk prompt cache: writer failed")
            finally:
                self._jobs.task_done()

    def _write(self, path: Path, tensors, metadata, size: int, parents: list):
        try:
            if not self.writable:
                return
            with self._lock:
                fits = self._evict(size + 4096, set(parents))
            if not fits:
                return
            try:
                written = write_block(path, tensors, metadata)
            except OSError as e:
                self._stop_writing(e)
                return
            with self._lock:
                self._files[path] = written
                self._bytes += written
                self._evict(0, {path, *parents})
            self.stats.written_blocks += 1
            self.stats.written_bytes += written
        finally:
            with self._room:
                self._pending.discard(path)
                self._pending_bytes -= size
                self._room.notify_all()

    def _stop_writing(self, error: OSError):
        self.writable = False
        self.stats.write_errors.append(str(error))
        log.warning(
            f"disk prompt cache: cannot write to {self.directory} "
            f"({error.strerror or error}); no more blocks will be written, "
            "serving goes on"
        )

    def flush(self):
        """Wait until every queued block is written (or dropped)."""
        self._jobs.join()


def read_ahead(paths):
    """Ask the kernel to read ``paths`` into the page cache: from a disk, all
    the reads queued at once come faster than a read at a time per thread."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def alive(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- maintenance ------------------------------------------------------------------


def check_directory(directory, remove: bool = False) -> tuple[int, list]:
    """Read back every block file under ``directory`` on its own (CRC, layout,
    key, hash of its parent and tokens): (blocks that pass, [(path, reason)]
    of those that do not, removed if ``remove``)."""
    good, bad = 0, []
    for info in sorted(Path(directory).glob("*/key.json")):
        try:
            key = json.loads(info.read_text())["key"]
        except (OSError, ValueError, KeyError) as e:
            bad.append((info, f"unreadable key ({type(e).__name__})"))
            continue
        for path in sorted(info.parent.iterdir()):
            if not HASH_NAME.fullmatch(path.name):
                continue
            try:
                metadata, tensors, _ = verify_block(path, key)
                Plan.from_block(metadata, tensors)
                good += 1
            except BadBlock as e:
                bad.append((path, str(e)))
                if remove:
                    path.unlink(missing_ok=True)
    return good, bad


def wait_for_blocks(directory, count: int, timeout: float = 120.0) -> int:
    """Wait until ``directory`` holds at least ``count`` block files and no
    temporary ones (a server's writes have landed); returns how many."""
    directory = Path(directory)
    deadline = time.monotonic() + timeout
    while True:
        blocks = sum(1 for p in directory.glob("*/*") if HASH_NAME.fullmatch(p.name))
        temps = any(directory.glob("*/*.tmp"))
        if blocks >= count and not temps:
            return blocks
        if time.monotonic() > deadline:
            raise TimeoutError(f"{blocks} of {count} blocks in {directory}")
        time.sleep(0.05)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Check the blocks of a disk prompt cache (--prompt-cache-dir)."
    )
    parser.add_argument("command", choices=["check"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--remove", action="store_true", help="remove bad blocks")
    args = parser.parse_args(argv)
    good, bad = check_directory(args.directory, remove=args.remove)
    for path, reason in bad:
        print(f"bad: {path}: {reason}")
    total = sum(p.stat().st_size for p in args.directory.glob("*/*" + SUFFIX))
    print(f"{good} good blocks, {len(bad)} bad, {total / 1e6:.1f} MB")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
