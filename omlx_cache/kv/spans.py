"""The tokens a store holds outside its pages, unquantized: one object.

- The first ``first`` tokens of every sequence (attention sinks), kept for
  good in the codecs' rotated domains as they were written (they are in the
  pages too; attention reads these instead). Token ``j`` of sequence ``i``
  is at row ``left_padding[i] + j`` (0 for a single sequence).
- The recent ones, after the pages: a residual of ``recent`` = R tokens
  (KIVI's: R to 2R - 1 of them held, the older ones written to the pages R at
  a time as they age), or the decode tokens a kernel asks to be held
  (``kernels.Hold``: up to its ``size``, written to the pages when one more
  comes).
"""

import mlx.core as mx

from .attention import First, Recent


def check_tokens(value, name: str, multiple: int = 1) -> int:
    """A number of tokens: an int, 0 or more, a multiple of ``multiple``."""
    if isinstance(value, bool) or not isinstance(value, int):
        # a setting's value: ValueError, as mlx-lm's checks raise
        raise ValueError(  # noqa: TRY004
            f"{name} must be a number of tokens (an int), got {value!r}."
        )
    if value < 0 or value % multiple:
        kind = "0 or more" if multiple == 1 else f"0 or a multiple of {multiple}"
        raise ValueError(f"{name} must be {kind}, got {value}.")
    return value


def with_first_rows(rows, first_rows, first, count):
    """``rows`` (B, heads, n, D) with each sequence's rows ``first[b]`` to
    ``first[b] + count`` replaced by its first ``count`` of ``first_rows``
    (B, heads, count or more, D): a batch's first tokens, kept unquantized,
    in place of their copies after each sequence's padding."""
    offset = mx.arange(rows.shape[-2])[None] - first[:, None]
    inside = ((offset >= 0) & (offset < count))[:, None, :, None]
    first_rows = first_rows[:, :, :count]
    index = mx.clip(offset, 0, count - 1)[:, None, :, None]
    index = mx.broadcast_to(index, (*first_rows.shape[:2], *rows.shape[2:]))
    kept = mx.take_along_axis(first_rows, index, axis=-2).astype(rows.dtype)
    return mx.where(inside, kept, rows)


def placed(slots, rows, pos):
    """``slots`` (B, heads, n, D) with sequence ``b``'s slot ``j`` replaced by
    its row ``pos[b, j]`` of ``rows`` (B, heads, T, D), where ``0 <= pos < T``."""
    T = rows.shape[2]
    inside = ((pos >= 0) & (pos < T))[:, None, :, None]
    index = mx.clip(pos, 0, T - 1)[:, None, :, None]
    index = mx.broadcast_to(index, (*rows.shape[:2], pos.shape[1], rows.shape[3]))
    return mx.where(inside, mx.take_along_axis(rows, index, axis=2), slots)


class Spans:
    def __init__(self, first: int = 0, recent: int = 0):
        self.first = check_tokens(first, "first")
        self.recent = check_tokens(recent, "recent", 8)
        self.first_keys = self.first_values = None
        self.held_keys = self.held_values = None
        self.n_held = 0
        # a kernel's held decode tokens (kernels.Hold), or None
        self.hold = None
        self.incoming = None

    @property
    def settings(self) -> dict:
        return {"first": self.first, "recent": self.recent}

    # the first tokens

    def keep_first(self, keys, values, start, left_padding=0):
        """Keep those of ``keys`` and ``values`` (B, heads, T, D; codec domain),
        which go to rows ``start`` on, that are among each sequence's first
        tokens."""
        n = self.first
        T = keys.shape[2]
        if not n:
            return
        if isinstance(left_padding, int):
            if start >= left_padding + n:
                return
        elif start >= max(left_padding.tolist(), default=0) + n:
            return
        if self.first_keys is None:
            if start > 0 and isinstance(left_padding, int):
                return
            self.first_keys, self.first_values = (
                mx.zeros((*x.shape[:2], n, x.shape[3]), x.dtype) for x in (keys, values)
            )
        if isinstance(left_padding, int):
            lo, hi = max(start, left_padding), min(start + T, left_padding + n)
            self.first_keys[:, :, lo - left_padding : hi - left_padding] = keys[
                :, :, lo - start : hi - start
            ]
            self.first_values[:, :, lo - left_padding : hi - left_padding] = values[
                :, :, lo - start : hi - start
            ]
            return
        # where each sequence's first tokens are among the new ones
        pos = left_padding[:, None] + mx.arange(n) - start
        self.first_keys = placed(self.first_keys, keys, pos)
        self.first_values = placed(self.first_values, values, pos)

    def first_tokens(self, left_padding=0):
        """The first tokens as attention reads them, or None."""
        if self.first_keys is None:
            return None
        return First(self.first_keys, self.first_values, left_padding, self.first)

    def drop_first(self):
        self.first_keys = self.first_values = None

    # the recent tokens

    def age(self, keys, values):
        """Add ``keys`` and ``values`` to a residual's held tokens; return what
        has aged out of it (to write to the pages), or None."""
        n, R = self.n_held, self.recent
        if n:
            keys, values = (
                mx.concatenate([x[:, :, :n], y], axis=2)
                for x, y in zip((self.held_keys, self.held_values), (keys, values))
            )
        total = keys.shape[2]
        aged = (total - R) // R * R if total >= 2 * R else 0
        # copies: slices would keep the whole chunk alive
        self.held_keys, self.held_values = (
            mx.contiguous(x[:, :, aged:]) for x in (keys, values)
        )
        self.n_held = total - aged
        if not aged:
            return None
        return keys[:, :, :aged], values[:, :, :aged]

    def buffer(self, keys, values, prepare):
        """Hold one decode token for a kernel (``hold``); return the held tokens
        the buffer had to let go of (to write to the pages), or None.
        ``prepare`` makes a token as the model made it what the buffer holds."""
        size = self.hold.size
        shape = (*keys.shape[:2], size)
        released = None
        if self.held_keys is None or self.held_keys.shape[:3] != shape:
            released = self.release(prepare)
            self.held_keys = mx.zeros((*shape, keys.shape[3]), keys.dtype)
            self.held_values = mx.zeros((*shape, values.shape[3]), values.dtype)
        self.land(prepare)
        if self.n_held == size:
            # written out as the next token comes, not as the last one lands:
            # every decode step attends a held token
            released = self.release(prepare)
        self.n_held += 1
        self.incoming = (keys, values)
        if not self.hold.incoming:
            self.land(prepare)
        return released

    def land(self, prepare):
        """Write the incoming token into the buffer."""
        if self.incoming is None:
            return
        keys, values = prepare(*self.incoming)
        self.incoming = None
        n = self.n_held - 1
        self.held_keys[:, :, n : n + 1] = keys.astype(self.held_keys.dtype)
        self.held_values[:, :, n : n + 1] = values.astype(self.held_values.dtype)

    def release(self, prepare=None):
        """All held tokens, to write to the pages (None if none)."""
        if prepare is not None:
            self.land(prepare)
        n = self.n_held
        if not n:
            return None
        self.n_held = 0
        keys, values = (x[:, :, :n] for x in (self.held_keys, self.held_values))
        if self.recent:
            self.held_keys = self.held_values = None
        return keys, values

    @property
    def rotated(self) -> bool:
        """Whether held tokens are in the codecs' rotated domains (a residual's
        are; a kernel's as it asks)."""
        return True if self.hold is None else self.hold.rotated

    def recent_tokens(self):
        """The held tokens as attention reads them, or None."""
        if not self.n_held:
            return None
        return Recent(
            self.held_keys, self.held_values, self.n_held, self.rotated, self.incoming
        )

    def trim_held(self, n):
        """Drop the newest ``n`` held tokens (a residual's): how many were."""
        n = min(n, self.n_held)
        self.n_held -= n
        self.held_keys, self.held_values = (
            mx.contiguous(x[:, :, : self.n_held])
            for x in (self.held_keys, self.held_values)
        )
        return n

    @property
    def nbytes(self):
        arrays = (self.first_keys, self.first_values, self.held_keys, self.held_values)
        return sum(x.nbytes for x in arrays if x is not None)
