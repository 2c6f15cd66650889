"""``omlx_cache.factory``, the KV cache factory mlx_lm.generate and mlx_lm.server
load through ``--kv-cache`` (entry points ``default`` and ``omlx``): flags into
one checked scheme, fitted at load, described in one line."""

import argparse
import importlib.metadata
import itertools
import json

import mlx.core as mx
import pytest
import tiny_gemma
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from test_server_real import QUESTIONS

from omlx_cache import factory, fit
from omlx_cache.kv.spec import PRESETS, KVSpec
from omlx_cache.kv.store import KVStore


@pytest.fixture(scope="module")
def smollm2(smollm2_dirs):
    return load(str(smollm2_dirs[1]))


def args(config=None, bits=None, group=64):
    return argparse.Namespace(kv_cache_config=config, kv_bits=bits, kv_group_size=group)


def test_entry_points_are_installed():
    for name in ("default", "omlx"):
        (entry,) = importlib.metadata.entry_points(group="mlx_lm.kv_caches", name=name)
        assert entry.load() is factory.from_args


@pytest.mark.parametrize(
    "given, spec",
    [
        (args(), "fp16"),
        (args(bits=4), "bits=4"),
        (args(bits=(8, 4), group=(64, 32)), "bits=8,4 group=64,32"),
        (args("rotate=none first=0", bits=4), "bits=4 rotate=none first=0"),
        (args("cq4"), PRESETS["cq4"]),
    ],
)
def test_flags_make_one_scheme(given, spec):
    assert factory.spec_from_args(given) == KVSpec.parse(spec)


@pytest.mark.parametrize(
    "given, message",
    [
        (args("q4", bits=4), "--kv-bits 4 and --kv-cache-config 'q4' both set"),
        (args(group=32), "--kv-group-size needs --kv-bits"),
        (args(bits=3, group=48), "group size must be one of"),
        (args("bits=4 rotate=q"), "--kv-cache-config 'bits=4 rotate=q': rotate='q'"),
        (args("4+centre"), "--kv-cache-config '4\\+centre'"),
        (args("rotate=none"), "needs bits="),
    ],
)
def test_bad_flags_are_named(given, message):
    with pytest.raises(ValueError, match=message):
        factory.from_args(given)


def test_caches_and_their_line(smollm2, capsys):
    model, _ = smollm2
    assert all(type(c) is KVCache for c in factory.from_args(args())(model))
    assert capsys.readouterr().err == ""
    make_cache = factory.from_args(args(bits=(8, 4)))
    caches = make_cache(model)
    assert all(type(c) is KVStore for c in caches)
    assert caches[0].key_codec.bits == 8 and caches[0].value_codec.bits == 4
    err = capsys.readouterr().err
    assert "30 of 30 layers quantized, 6.54 bits per element" in err
    make_cache(model)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "hidden, line",
    [
        (192, "group size 32 (64 does not divide head dim 96)"),
        (160, "unquantized (no group size up to 64 divides head dim 80)"),
    ],
)
def test_head_dims_the_group_does_not_divide(capsys, hidden, line):
    """Phi-3's head dim 96 gets group size 32, Phi-2's 80 stays unquantized:
    the load line says so once; the logits stay fp16's (8-bit)."""
    import tiny_llama
    from mlx_lm.models import llama

    config = dict(tiny_llama.CONFIG, hidden_size=hidden, num_attention_heads=2)
    config.update(num_key_value_heads=2)
    config.pop("head_dim", None)
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    caches = factory.from_args(args(bits=8))(model)
    err = capsys.readouterr().err
    assert f"omlx_cache: keys and values of layers 0-1: {line}" in err
    quantized = "2 of 2" if hidden == 192 else "0 of 2"
    assert f"{quantized} layers quantized" in err
    tokens = mx.array([list(range(1, 12))])
    want = model(tokens, cache=[KVCache() for _ in caches])
    got = model(tokens, cache=caches)
    assert mx.abs(got - want).max().item() < 0.05 * mx.abs(want).max().item()


def test_max_kv_size_bounds_the_unbounded_layers_only():
    model = tiny_gemma.tiny_gemma()
    plain = factory.from_args(args("q4-recall"))(model)
    bounded = factory.from_args(args("q4-recall"))(model, 64)
    assert [c.window for c in plain] == [16, 16, None]
    # a sliding-window layer keeps its own window
    assert [(c.window, c.keep) for c in bounded] == [(16, 0), (16, 0), (64, 4)]


def test_reused_prefix_answers_as_a_fresh_cache(smollm2):
    """The server trims a cached prompt to the prefix the next request shares
    with it: q4's recent tokens stay held through the trim, so every question
    answers as from a fresh cache, whichever came before."""
    model, tokenizer = smollm2
    spec = KVSpec.parse("q4")

    def answer(prompt, cache):
        steps = generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=8)
        return [int(token) for token, _ in steps]

    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    fresh = [answer(p, spec.make_cache(model)) for p in prompts]
    for before, after in itertools.permutations(range(len(prompts)), 2):
        a, b = prompts[before], prompts[after]
        shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        cache = spec.make_cache(model)
        answer(a, cache)
        for c in cache:
            c.trim(c.offset - shared)
        assert answer(b[shared:], cache) == fresh[after], (before, after)


def test_cq4_fits_its_layers_when_the_caches_are_first_made(
    tmp_path, monkeypatch, capsys
):
    """``--kv-cache-config cq4`` on a Gemma-like model: 5-bit keys in the
    layers fitted within 4.6 bits on text the model samples, once, in two
    lines (a second factory reads the profile)."""
    monkeypatch.setenv("OMLX_CACHE_HOME", str(tmp_path))
    model = tiny_gemma.tiny_gemma()
    caches = factory.from_args(args("cq4"))(model)
    err = capsys.readouterr().err.splitlines()
    # on text as long as its 16-token windows (fit.fit_tokens)
    assert "16 sampled tokens" in err[0] and len(err) == 3
    assert [c.value_codec.bits for c in caches] == [4, 4, 4]
    (profile,) = (tmp_path / "profiles").glob("*.json")
    chosen = [i for i, c in enumerate(caches) if c.key_codec.bits == 5]
    assert json.loads(profile.read_text())["layers"] == chosen
    fit._fitted.clear()
    factory.from_args(args("cq4"))(model)
    assert "fit" not in capsys.readouterr().err


def test_a_model_that_reads_its_keys_keeps_its_bounded_caches():
    """Gemma 2 attends by itself (softcapping): with ``--max-kv-size`` its
    layers keep their own rotating caches (a quantized window's rows do not
    carry its sinks), and the load line says so; unbounded, they are stores."""
    from mlx_lm.models import gemma2
    from mlx_lm.models.cache import RotatingKVCache

    config = {"model_type": "gemma2", "hidden_size": 128, "num_hidden_layers": 2}
    config |= {"intermediate_size": 256, "num_attention_heads": 2, "head_dim": 64}
    config |= {"rms_norm_eps": 1e-4, "vocab_size": 128, "num_key_value_heads": 2}
    model = gemma2.Model(gemma2.ModelArgs.from_dict(config))
    spec = KVSpec.parse("bits=8")
    assert all(type(c) is RotatingKVCache for c in spec.make_cache(model, 16))
    line = factory.describe(spec, model, 16)
    assert "0 of 2 layers quantized" in line
    assert "bounded layers 0-1 keep the model's own caches" in line
    assert all(isinstance(c, KVStore) for c in spec.make_cache(model))
    assert "2 of 2 layers quantized" in factory.describe(spec, model)
    assert "bounded layers" not in factory.describe(spec, model)


def test_the_load_line_names_caches_with_no_quantized_form():
    """Llama 4's chunked layers keep their ``ChunkedKVCache``: the load line
    counts the layers quantized and names the others."""
    from mlx_lm.models import llama4
    from mlx_lm.models.cache import ChunkedKVCache

    text = {"model_type": "llama4", "attention_chunk_size": 8, "head_dim": 32}
    text |= {"hidden_size": 128, "interleave_moe_layer_step": 2, "vocab_size": 100}
    text |= {"intermediate_size": 128, "intermediate_size_mlp": 128}
    text |= {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4}
    text |= {"num_experts_per_tok": 1, "num_local_experts": 2, "rms_norm_eps": 1e-4}
    text |= {"rope_scaling": None, "rope_theta": 1000, "use_qk_norm": True}
    text |= {"attention_bias": False, "max_position_embeddings": 1000}
    config = {"model_type": "llama4", "text_config": text, "vocab_size": 100}
    model = llama4.Model(llama4.ModelArgs.from_dict(config))
    spec = KVSpec.parse("bits=8 group=32")
    caches = spec.make_cache(model)
    chunked = [i for i, c in enumerate(caches) if isinstance(c, ChunkedKVCache)]
    assert chunked == [0, 1, 2]
    line = factory.describe(spec, model)
    assert "1 of 4 layers quantized" in line
    assert (
        "layers 0-2 keep the model's own ChunkedKVCache (no quantized form yet)" in line
    )
