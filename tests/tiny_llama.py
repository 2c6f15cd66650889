"""A tiny random llama (2 layers, GQA 4 q / 2 kv heads, head_dim 64) shared by the tests."""

import mlx.core as mx
from mlx_lm.models import llama

CONFIG = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "vocab_size": 320,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


def make_model(seed: int = 7) -> llama.Model:
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(CONFIG))
    mx.eval(model.parameters())
    return model
