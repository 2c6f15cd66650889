"""What the eval and the fit share: log-probabilities of a text through a
cache, the per-token statistics against a reference, a progress line."""

import sys
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten


def window_logprobs(
    model: nn.Module,
    tokens: mx.array,
    cache: list,
    chunk: int,
    on_chunk: Callable[[], None] | None = None,
) -> mx.array:
    """Float32 log-probabilities of the next token at each position but the
    last, shape (len(tokens) - 1, vocab), feeding ``tokens`` through ``cache``
    ``chunk`` tokens at a time."""
    inputs = tokens[:-1]
    parts = []
    for start in range(0, inputs.size, chunk):
        logits = model(inputs[None, start : start + chunk], cache=cache)[0]
        logits = logits.astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(logprobs)
        parts.append(logprobs)
        if on_chunk is not None:
            on_chunk()
    return mx.concatenate(parts, axis=0)


def token_stats(logprobs: mx.array, targets: mx.array, reference: mx.array):
    """Per-token NLL of ``targets``, KL(reference || logprobs) and whether the
    argmax agrees with the reference's, as numpy arrays."""
    nll = -mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
    kld = mx.sum(mx.exp(reference) * (reference - logprobs), axis=-1)
    top1 = mx.argmax(reference, axis=-1) == mx.argmax(logprobs, axis=-1)
    mx.eval(nll, kld, top1)
    return np.array(nll), np.array(kld), np.array(top1)


def model_dtype(model: nn.Module) -> str:
    """The dtype of the model's floating-point parameters, e.g. ``"float32"``."""
    dtypes = {x.dtype for _, x in tree_flatten(model.parameters())}
    floating = sorted(
        str(d).split(".")[-1] for d in dtypes if mx.issubdtype(d, mx.floating)
    )
    return ",".join(floating)


def format_seconds(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes}:{seconds:02d}"


class Progress:
    """Progress on stderr: on a terminal a bar redrawn in place with ``\\r``;
    elsewhere (a server's log) a line at most every ``every`` steps' tenth
    of the total."""

    def __init__(self, total: int, stream=None, width: int = 24):
        self.total = total
        self.done = 0
        self.stream = stream or sys.stderr
        self.width = width
        self.start = time.perf_counter()
        self.label = ""
        self.last_len = 0
        self.live = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.reported = 0

    def step(self):
        self.done += 1
        self.draw()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0
        return (
            f"{self.done}/{self.total} {self.label}"
            f"  {format_seconds(elapsed)} elapsed, {format_seconds(eta)} left"
        )

    def draw(self):
        if not self.live:
            # a tenth of the way at a time, one line each
            tenth = 10 * self.done // max(self.total, 1)
            if tenth > self.reported or self.done == self.total:
                self.reported = tenth
                self.stream.write(self.line() + "\n")
                self.stream.flush()
            return
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        line = f"[{bar}] {self.line()}"
        self.stream.write("\r" + line.ljust(self.last_len))
        self.stream.flush()
        self.last_len = len(line)

    def close(self):
        if self.live:
            self.stream.write("\n")
            self.stream.flush()
