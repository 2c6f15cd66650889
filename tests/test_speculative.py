"""Speculative decoding (``mlx_lm.generate --draft-model``) with a quantized
cache: the main model's caches are stores, the draft's its own (as
``mlx_lm.generate`` makes them with ``--kv-cache``). Greedy, a draft with
other weights (so drafts are rejected and the stores trimmed): the tokens
are the ones plain generation with the same stores gives. Models: llama,
DeepSeek V3 (MLA latent caches), Gemma 3 (sliding-window and global
layers); a hybrid with recurrent state (LFM2) is refused as fp16 is (its
state cannot be trimmed back)."""

import importlib

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache
from tiny_llama import CONFIG

from omlx_cache.kv.spec import KVSpec, stores

MODELS = {
    "llama": CONFIG,
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "vocab_size": 256,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_group": 2,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "kv_lora_rank": 64,
        "q_lora_rank": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 32,
        "qk_nope_head_dim": 32,
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "hidden_size": 128,
        "num_hidden_layers": 3,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "head_dim": 32,
        "rms_norm_eps": 1e-4,
        "num_key_value_heads": 1,
        "vocab_size": 256,
        "sliding_window": 64,
        "sliding_window_pattern": 3,
    },
    "lfm2": {
        "model_type": "lfm2",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "norm_eps": 1e-5,
        "vocab_size": 256,
        "full_attn_idxs": [0],
        "rope_theta": 10000,
        "block_dim": 128,
        "block_ff_dim": 256,
        "block_multiple_of": 64,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "max_position_embeddings": 1000,
        "conv_bias": True,
        "conv_L_cache": 3,
    },
}
SPEC = KVSpec.parse("bits=8 group=32")


def build(config, noise=0.0):
    """The model with seed 0's weights, each times 1 + ``noise`` x N(0, 1) (a
    draft that agrees with the model often, not always)."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))

    def perturbed(p):
        if not mx.issubdtype(p.dtype, mx.floating):
            return p
        p = p.astype(mx.float32)
        return p * (1 + noise * mx.random.normal(p.shape)) if noise else p

    model.update(tree_map(perturbed, model.parameters()))
    mx.eval(model.parameters())
    return model


def tokens_of(steps):
    return [int(token) for token, *_ in steps]


@pytest.mark.parametrize("name", ["llama", "deepseek_v3", "gemma3_text"])
def test_speculative_decoding_over_stores(name):
    model, draft = build(MODELS[name]), build(MODELS[name], noise=0.3)
    prompt = mx.array([(7 * i + 3) % 256 for i in range(90)])
    cache = SPEC.make_cache(model)
    assert stores(cache), "the main model's caches are stores"
    plain = tokens_of(generate_step(prompt, model, prompt_cache=cache, max_tokens=24))
    cache = SPEC.make_cache(model) + make_prompt_cache(draft)
    steps = list(
        speculative_generate_step(
            prompt, model, draft, prompt_cache=cache, num_draft_tokens=3, max_tokens=24
        )
    )
    assert tokens_of(steps) == plain
    drafted = [from_draft for _, _, from_draft in steps]
    # some drafts accepted, some rejected: the stores were trimmed back
    assert any(drafted) and not all(drafted)


def test_a_hybrid_is_refused_as_with_its_own_caches():
    model, draft = build(MODELS["lfm2"]), build(MODELS["lfm2"], noise=0.3)
    prompt = mx.array(list(range(20)))
    errors = []
    for cache in (make_prompt_cache(model), SPEC.make_cache(model)):
        cache = cache + make_prompt_cache(draft)
        with pytest.raises(ValueError, match="requires a trimmable prompt cache") as e:
            next(speculative_generate_step(prompt, model, draft, prompt_cache=cache))
        errors.append(str(e.value))
    assert errors[0] == errors[1]
