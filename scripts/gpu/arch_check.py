"""Architectures whose attention is not llama's, with quantized caches (GPU machine).

Small random models with real head dims (64 and up, so the CUDA kernels can
take them): GPT-OSS (attention sinks, alternating windows), DeepSeek V3 (MLA
latent caches), Gemma 3n (KV-shared layers), Gemma 2 (softcapped attention
written in the model), and llama as the control. Each runs a prompt in
chunks, then decode steps, in float16 with its own caches ("own") and with each KV
scheme; the reference is the same model in float32 with its own caches.
Per model and scheme: the worst logit error relative to the reference's
largest logit, and which attention kernels ran (their calls), so the CUDA
paths are named.

    python3 scripts/gpu/arch_check.py --schemes 8 4 8,4 --out $OUT/arch-check.json
"""

import argparse
import collections
import importlib
import json

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import make_prompt_cache

from omlx_cache.kv import kernels
from omlx_cache.kv.spec import KVSpec

MODELS = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "intermediate_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 1000,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "intermediate_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 128,
        "rope_theta": 10000,
        "vocab_size": 1000,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "vocab_size": 1000,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "n_routed_experts": 4,
        "n_group": 2,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "kv_lora_rank": 128,
        "q_lora_rank": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 64,
    },
    "gemma3n": {
        "model_type": "gemma3n",
        "text_config": {
            "model_type": "gemma3n",
            "hidden_size": 512,
            "num_hidden_layers": 4,
            "intermediate_size": 1024,
            "num_attention_heads": 4,
            "head_dim": 128,
            "rms_norm_eps": 1e-5,
            "vocab_size": 1000,
            "num_key_value_heads": 2,
            "num_kv_shared_layers": 2,
            "vocab_size_per_layer_input": 1000,
            "sliding_window": 128,
            "max_position_embeddings": 4096,
            "rope_local_base_freq": 10000.0,
            "rope_theta": 1000000.0,
            "final_logit_softcapping": 30.0,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "activation_sparsity_pattern": [0.0] * 4,
            "hidden_size_per_layer_input": 64,
            "altup_num_inputs": 2,
            "altup_coef_clip": 120.0,
            "altup_correct_scale": True,
            "altup_active_idx": 0,
            "laurel_rank": 16,
        },
    },
    "gemma2": {
        "model_type": "gemma2",
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "intermediate_size": 1024,
        "num_attention_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "vocab_size": 1000,
        "num_key_value_heads": 4,
    },
}


def build(config, dtype):
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: p.astype(dtype), model.parameters()))
    mx.eval(model.parameters())
    return model


def logits(model, cache, tokens, prompt, chunk):
    out = []
    for start in range(0, prompt, chunk):
        out.append(
            model(tokens[:, start : min(start + chunk, prompt)], cache=cache)[:, -1]
        )
    for i in range(prompt, tokens.shape[1]):
        out.append(model(tokens[:, i : i + 1], cache=cache)[:, -1])
    return mx.stack(out, axis=1).astype(mx.float32)


class Counted:
    """Counts each registered attention kernel's runs (re-registered in
    order, through the registry)."""

    def __init__(self):
        self.calls = collections.Counter()
        for kernel in kernels.attention_kernels():
            kernels.register_attention(
                kernels.Kernel(
                    kernel.name, kernel.applies, self._count(kernel), kernel.hold
                )
            )

    def _count(self, kernel):
        def run(call):
            out = kernel.run(call)
            if out is not None:
                self.calls[kernel.name] += 1
            return out

        return run

    def take(self):
        calls, self.calls = dict(self.calls), collections.Counter()
        return calls


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=list(MODELS), choices=list(MODELS)
    )
    parser.add_argument("--schemes", nargs="+", default=["8", "4", "8,4"])
    parser.add_argument("--prompt", type=int, default=600)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--decode", type=int, default=24)
    parser.add_argument(
        "--dtype",
        default="float16",
        choices=["float16", "bfloat16", "float32"],
        help="the checked models' (float32 on the CPU: its MoE takes no halves)",
    )
    parser.add_argument("--out", required=True)
    opts = parser.parse_args(argv)
    specs = [KVSpec.parse(s) for s in opts.schemes]
    counted = Counted()
    rows = []
    for name in opts.models:
        config = MODELS[name]
        vocab = config.get("text_config", config)["vocab_size"]
        tokens = mx.random.randint(
            0, vocab, (1, opts.prompt + opts.decode), key=mx.random.key(1)
        )
        reference = build(config, mx.float32)
        want = logits(
            reference, make_prompt_cache(reference), tokens, opts.prompt, opts.chunk
        )
        scale = mx.abs(want).max().item()
        del reference
        model = build(config, getattr(mx, opts.dtype))
        for scheme, spec in [("own", None), *zip(opts.schemes, specs)]:
            cache = make_prompt_cache(model) if spec is None else spec.make_cache(model)
            got = logits(model, cache, tokens, opts.prompt, opts.chunk)
            error = mx.abs(got - want).max().item() / scale
            agree = (got.argmax(-1) == want.argmax(-1)).mean().item()
            row = {
                "model": name,
                "scheme": scheme,
                "rel_err": error,
                "top1_agree": agree,
                "caches": sorted({type(c).__name__ for c in cache}),
                "kernels": counted.take(),
            }
            rows.append(row)
            print(
                f"{name:<12} {scheme:<6} rel err {error:.2e}  top-1 {agree:.3f}"
                f"  kernels {row['kernels'] or 'none (MLX ops)'}",
                flush=True,
            )
    with open(opts.out, "w") as f:
        json.dump(
            {"device": mx.device_info(), "options": vars(opts), "rows": rows},
            f,
            indent=1,
            default=str,
        )


if __name__ == "__main__":
    main()
