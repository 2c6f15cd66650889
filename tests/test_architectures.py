"""Every architecture upstream's tests/test_models.py builds, with an 8-bit
quantized cache (``bits=8 group=32``, what ``--kv-bits 8 --kv-group-size 32``
makes), against the same model with its own caches: a 9-token prompt, then
decode tokens, float32 on the CPU. Each model runs, its attention caches are
quantized where their head dims allow (``KVSpec.quantized_layers`` says how
many; the others are stored unquantized), and its logits stay near fp16's.
Then the paths a user runs: a bounded window (``--max-kv-size 16``, against
the same window unquantized), two prompts through ``BatchGenerator`` (the
server's batch; each gets its tokens alone) and a saved and loaded cache;
each passes or fails as the model's own caches do on it.

Upstream's test builds each model and hands it to ``model_test_runner``;
this subclass runs the check there instead. Models over ``MAX_PARAMETERS``
(upstream builds some at full size, never evaluated) are rebuilt at a small
shape (``_small``), or skipped where that cannot be done.
``docs/architectures.md`` is this test's table.
"""

import dataclasses
import sys
import tempfile
import unittest
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from omlx_cache.kv.spec import KVSpec, layer_shapes, stores

sys.path.insert(0, str(Path(mlx_lm.__file__).parents[1] / "tests"))
import test_models

SPEC = KVSpec.parse("bits=8 group=32")
MAX_PARAMETERS = 300_000_000
# 8-bit keys and values: a logit moves by a few hundredths of the largest
# (a MoE router's near tie more); garbage moves it by more than this
TOLERANCE = 0.15
# what does not run, and why
EXPECTED = {
    "bitnet": "its kernel is Metal's only",
    "plamo3": (
        "masks a window of window_size + 1 over a cache of window_size: a "
        "prompt's oldest token is seen by upstream's rotating cache, not by the "
        "store's window"
    ),
}
# upstream's tests that fail on the CPU with any cache (tests/upstream-deselect.txt)
DESELECTED = {
    line.split("::")[-1].split()[0]
    for line in (Path(__file__).parent / "upstream-deselect.txt")
    .read_text()
    .splitlines()
    if line.startswith("tests/test_models.py::")
}
RESULTS = {}
# models upstream's test builds over MAX_PARAMETERS, run here at a small shape
SMALL = set()
HEAD_FIELDS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
KV_HEAD_FIELDS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
WIDTH_FIELDS = {"hidden_size", "n_embd", "d_model"}
MLP_FIELDS = {"intermediate_size", "ffn_dim", "n_inner"}
DIM_FIELDS = {"head_dim", "kv_channels"}
SMALL_HEAD_DIM = {"phi": 80}
# afm7 rounds its keys and values to an 8-bit grid of a learned step, 1 in
# upstream's test: whole numbers, on which any rounding difference (the
# cache's, or float16's) moves a key by a whole step. A checkpoint's steps
# are small (its keys' range over 255); the test uses 1/32.
FAKE_QUANT_STEP = 1 / 32
QUANTIZED_KINDS = {"KVCache", "RotatingKVCache", "CacheList"}
STATE_KINDS = {"ArraysCache", "MambaCache"}


def _quantized_dims(shapes):
    return {
        s.key_dim
        for i, s in enumerate(shapes)
        if s and any(c.spec != "plain" for c in SPEC.layer_codecs(s, i))
    }


def _logits(model, cache, tokens, start=0):
    out = [model(tokens[:, start:9], cache=cache)[:, -1]] if start < 9 else []
    for i in range(max(start, 9), tokens.shape[1]):
        out.append(model(tokens[:, i : i + 1], cache=cache)[:, -1])
    return mx.stack(out, axis=1)


def _relative(got, want):
    finite = mx.isfinite(want)
    error = mx.where(finite, mx.abs(got - want), 0).max().item()
    return error / (mx.where(finite, mx.abs(want), 0).max().item() or 1)


def _window(model, tokens):
    """``--max-kv-size 16``, 24 tokens: the stores' window against the same
    window unquantized (``bits=16``; the model's own bounded caches let a
    prefill chunk longer than the window see all of itself, the stores do
    not)."""
    tokens = mx.concatenate([tokens, tokens[:, :11]], axis=1)
    want = _logits(model, KVSpec.parse("bits=16").make_cache(model, 16), tokens)
    return _relative(_logits(model, SPEC.make_cache(model, 16), tokens), want)


def _saved(model, tokens, path, make=None):
    """The caches saved after the prompt and loaded: the decode logits as
    without the round trip."""
    make = make or SPEC.make_cache
    want = _logits(model, make(model), tokens)[:, 1:]
    cache = make(model)
    model(tokens[:, :9], cache=cache)
    save_prompt_cache(str(path), cache)
    return _relative(_logits(model, load_prompt_cache(str(path)), tokens, 9), want)


def _batched(model, tokens, make=None):
    """Two prompts (9 and 6 tokens) served together by ``BatchGenerator``, as
    the server serves them: whether each gets the greedy tokens it gets
    alone."""
    make = make or SPEC.make_cache
    prompts = [tokens[0, :9].tolist(), tokens[0, 3:9].tolist()]
    alone = []
    for prompt in prompts:
        steps = generate_step(
            mx.array(prompt), model, max_tokens=4, prompt_cache=make(model)
        )
        alone.append([int(token) for token, _ in steps])
    gen = BatchGenerator(model, max_tokens=4, completion_batch_size=2)
    uids = gen.insert(prompts, caches=[make(model) for _ in prompts])
    got = {uid: [] for uid in uids}
    while responses := gen.next_generated():
        for r in responses:
            got[r.uid].append(r.token)
    gen.close()
    return [got[uid] for uid in uids] == alone


def _failed(outcome) -> bool:
    return outcome is False or isinstance(outcome, str)


def _outcome(run):
    try:
        return run()
    except Exception as e:  # noqa: BLE001 (a path's failure is its result)
        return f"{type(e).__name__}: {e}".splitlines()[0][:100]


def _parameters(model) -> int:
    return sum(p.size for _, p in tree_flatten(model.parameters()))


def _small(model):
    """The model rebuilt at a small shape (upstream's test builds some at full
    size): 8 heads of 64 dims (Phi's 80, as its partial rotary needs), MLP
    width 256, a vocabulary of 1,000; None if its arguments are not a
    dataclass of the usual names."""
    args = getattr(model, "args", None)
    if not dataclasses.is_dataclass(args):
        return None
    fields = {f.name for f in dataclasses.fields(args)}
    heads = next((n for n in HEAD_FIELDS if n in fields), None)
    if heads is None:
        return None
    dim = SMALL_HEAD_DIM.get(args.model_type, 64)
    kv = next((n for n in KV_HEAD_FIELDS if n in fields and getattr(args, n)), None)
    changes = {heads: 8, "vocab_size": 1000}
    if kv is not None:
        changes[kv] = 8 if getattr(args, kv) == getattr(args, heads) else 2
    for name in fields & WIDTH_FIELDS:
        changes[name] = 8 * dim
    for name in fields & MLP_FIELDS:
        if getattr(args, name) is not None:
            changes[name] = 256
    for name in fields & DIM_FIELDS:
        if getattr(args, name) is not None:
            changes[name] = dim
    try:
        return type(model)(dataclasses.replace(args, **changes))
    except Exception:  # noqa: BLE001 (not shrinkable this way)
        return None


class Architectures(test_models.TestModels):
    __test__ = False  # run through test_architecture below

    def setUp(self):
        mx.random.seed(0)

    def model_test_runner(self, model, model_type, vocab_size, num_layers):
        if _parameters(model) > MAX_PARAMETERS:
            model = _small(model)
            if model is None or _parameters(model) > MAX_PARAMETERS:
                RESULTS[self.id(), model_type] = "skipped"
                return
            SMALL.add(model_type)
            vocab_size = model.args.vocab_size
        model.update(
            tree_map(
                lambda p: (
                    p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p
                ),
                model.parameters(),
            )
        )
        for layer in model.layers:
            attention = getattr(layer, "self_attn", None)
            if hasattr(attention, "quant_key_scale"):
                attention.quant_key_scale = mx.array(FAKE_QUANT_STEP)
                attention.quant_value_scale = mx.array(FAKE_QUANT_STEP)
        tokens = mx.array([[(7 * i + 3) % vocab_size for i in range(13)]])
        want = _logits(model, make_prompt_cache(model), tokens)
        cache = SPEC.make_cache(model)
        try:
            got = _logits(model, cache, tokens)
        except Exception as e:
            RESULTS[self.id(), model_type] = f"{type(e).__name__}: {e}"
            raise
        shapes = layer_shapes(model)
        quantized = SPEC.quantized_layers(shapes)
        attention = sum(s is not None for s in shapes)
        # a CacheList's stores (its layers have no one shape)
        listed = [c for c in cache if hasattr(c, "caches")]
        attention += len(listed)
        quantized += sum(
            any(s.key_codec.spec != "plain" for s in stores(c.caches)) for c in listed
        )
        if listed and not any(stores(c.caches) for c in listed):
            kinds = {
                "CacheList kept as it is (the model writes into its caches' arrays)"
            }
        else:
            kinds = {type(c).__name__ for c in make_prompt_cache(model)}
        finite = mx.isfinite(want)
        error = mx.where(finite, mx.abs(got - want), 0).max().item()
        scale = mx.where(finite, mx.abs(want), 0).max().item()
        small = {s.key_dim for s in shapes if s} - _quantized_dims(shapes)
        for c in listed:
            small |= {
                s.key_pages[0][0].shape[-1]
                for s in stores(c.caches)
                if s.key_codec.spec == "plain" and s.key_pages
            }
        unquantized = sorted(small)
        RESULTS[self.id(), model_type] = (
            quantized,
            attention,
            error / (scale or 1),
            sorted(kinds - QUANTIZED_KINDS - STATE_KINDS),
            unquantized,
            paths := self._paths(model, tokens),
        )
        self.assertLessEqual(error, TOLERANCE * scale, model_type)
        for name, value in paths.items():
            if isinstance(value, tuple):
                # a failure the model's own caches have too
                self.assertTrue(_failed(value[1]), f"{model_type} {name}: {value[0]}")
            elif name == "batch":
                self.assertTrue(value, f"{model_type}: batched tokens differ")
            else:
                self.assertLessEqual(value, TOLERANCE, f"{model_type} {name}")

    def _paths(self, model, tokens):
        """The other paths a user runs: a bounded window, the server's batch,
        a saved and loaded cache; each its error (batch: whether its tokens
        are each prompt's alone) or why it failed."""
        paths = {}
        with tempfile.TemporaryDirectory() as tmp:
            file = Path(tmp) / "c.safetensors"
            for name, run, own in (
                ("window", lambda: _window(model, tokens), None),
                (
                    "batch",
                    lambda: _batched(model, tokens),
                    lambda: _batched(model, tokens, make_prompt_cache),
                ),
                (
                    "saved",
                    lambda: _saved(model, tokens, file),
                    lambda: _saved(model, tokens, file, make_prompt_cache),
                ),
            ):
                paths[name] = _outcome(run)
                if own and _failed(paths[name]):
                    # what the model's own caches do on the same path
                    paths[name] = (paths[name], _outcome(own))
        return paths


def _cases():
    loader = unittest.TestLoader()
    return [
        name
        for name in loader.getTestCaseNames(Architectures)
        if not name.startswith("test_switch") and name not in DESELECTED
    ]


@pytest.mark.parametrize("name", _cases())
def test_architecture(name):
    case = Architectures(name)
    result = unittest.TestResult()
    case.run(result)
    expected, unexpected = [], []
    for test, text in result.errors + result.failures:
        model = next((m for m in EXPECTED if f"'{m}'" in str(test)), None)
        if model is None and name.removeprefix("test_") in EXPECTED:
            model = name.removeprefix("test_")
        (expected if model else unexpected).append(model or text)
    if unexpected:
        pytest.fail(unexpected[0])
    if expected:
        pytest.xfail("; ".join(f"{m}: {EXPECTED[m]}" for m in expected))
    if result.skipped:
        pytest.skip(result.skipped[0][1])


def _path_cells(paths) -> str:
    cells = []
    for name in ("window", "batch", "saved"):
        value, own = (
            paths[name] if isinstance(paths[name], tuple) else (paths[name], None)
        )
        if value is True:
            cells.append("as alone")
        elif isinstance(value, float):
            cells.append(f"within {value:.3f}")
        else:
            cell = "tokens differ from alone" if value is False else f"fails: {value}"
            if own == value or (isinstance(own, str) and isinstance(value, str)):
                cell += " (so do the model's own caches)"
            elif own is True or isinstance(own, float):
                cell += " (not with the model's own caches)"
            cells.append(cell)
    return " | ".join(cells)


def table() -> str:
    """The markdown table of docs/architectures.md: each architecture, its
    attention layers quantized and its worst logit error against fp16's."""
    for name in _cases():
        Architectures(name).run(unittest.TestResult())
    rows = {}
    for (test, model), result in RESULTS.items():
        if result == "skipped":
            cell = f"not run here (over {MAX_PARAMETERS // 10**6}M parameters)"
        elif isinstance(result, str):
            cell = f"fails: {EXPECTED.get(model, result.splitlines()[0])}"
        else:
            quantized, attention, error, others, small, paths = result
            cell = f"{quantized} of {attention} quantized, logits within {error:.3f}"
            if model in SMALL:
                cell = f"(small shape) {cell}"
            cell += " | " + _path_cells(paths)
            if small:
                dims = ", ".join(map(str, small))
                cell += f"; head dim {dims} (this test's) stored unquantized"
            for other in others:
                if "(" not in other:
                    other += " not quantized (no quantized form yet)"
                cell += f"; {other}"
        rows.setdefault(model, cell)
    header = (
        "| architecture | `bits=8 group=32` against fp16 | `--max-kv-size 16` against "
        "`bits=16` | two prompts through `BatchGenerator` | saved, loaded |"
    )
    lines = [header, "|---|---|---|---|---|"]
    for m, c in sorted(rows.items()):
        cells = c.count(" | ")
        lines.append(f"| {m} | {c}{' | —' * (3 - cells)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
