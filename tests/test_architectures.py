"""Every architecture upstream's tests/test_models.py builds, with an 8-bit
quantized cache (``bits=8 group=32``, what ``--kv-bits 8 --kv-group-size 32``
makes), against the same model with its own caches: a 9-token prompt, then
decode tokens, float32 on the CPU. Each model runs, its attention caches are
quantized where their head dims allow (``KVSpec.quantized_layers`` says how
many; the others are stored unquantized), and its logits stay near fp16's.

Upstream's test builds each model and hands it to ``model_test_runner``;
this subclass runs the check there instead. Models over ``MAX_PARAMETERS``
(upstream builds some at full size, never evaluated) are skipped.
``docs/architectures.md`` is this test's table.
"""

import sys
import unittest
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import make_prompt_cache

from omlx_cache.kv.spec import KVSpec, layer_shapes, stores

sys.path.insert(0, str(Path(mlx_lm.__file__).parents[1] / "tests"))
import test_models

SPEC = KVSpec.parse("bits=8 group=32")
MAX_PARAMETERS = 150_000_000
# 8-bit keys and values: a logit moves by a few hundredths of the largest
# (a MoE router's near tie more); garbage moves it by more than this
TOLERANCE = 0.15
# what does not run, and why
EXPECTED = {
    "afm7": "KV-reuse layers read another layer's cache as a tuple",
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
QUANTIZED_KINDS = {"KVCache", "RotatingKVCache", "CacheList"}
STATE_KINDS = {"ArraysCache", "MambaCache"}


def _quantized_dims(shapes):
    return {
        s.key_dim
        for i, s in enumerate(shapes)
        if s and any(c.spec != "plain" for c in SPEC.layer_codecs(s, i))
    }


def _logits(model, cache, tokens):
    out = [model(tokens[:, :9], cache=cache)[:, -1]]
    for i in range(9, tokens.shape[1]):
        out.append(model(tokens[:, i : i + 1], cache=cache)[:, -1])
    return mx.stack(out, axis=1)


class Architectures(test_models.TestModels):
    __test__ = False  # run through test_architecture below

    def setUp(self):
        mx.random.seed(0)

    def model_test_runner(self, model, model_type, vocab_size, num_layers):
        parameters = sum(p.size for _, p in tree_flatten(model.parameters()))
        if parameters > MAX_PARAMETERS:
            RESULTS[self.id(), model_type] = "skipped"
            return
        model.update(
            tree_map(
                lambda p: (
                    p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p
                ),
                model.parameters(),
            )
        )
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
        )
        self.assertLessEqual(error, TOLERANCE * scale, model_type)


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
            quantized, attention, error, others, small = result
            cell = f"{quantized} of {attention} quantized, logits within {error:.3f}"
            if small:
                dims = ", ".join(map(str, small))
                cell += f"; head dim {dims} (this test's) stored unquantized"
            for other in others:
                if "(" not in other:
                    other += " not quantized (no quantized form yet)"
                cell += f"; {other}"
        rows.setdefault(model, cell)
    lines = ["| architecture | `bits=8 group=32` against fp16 |", "|---|---|"]
    lines += [f"| {m} | {c} |" for m, c in sorted(rows.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
