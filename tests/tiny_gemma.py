"""A tiny random Gemma 3 (two 16-token sliding-window layers and a global
one, 2 q / 1 kv heads, head_dim 64) shared by the tests."""

import mlx.core as mx
from mlx_lm.models import gemma3_text

TINY_GEMMA = {
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 128,
    "sliding_window": 16,
    "sliding_window_pattern": 3,
}


def tiny_gemma(seed: int = 0) -> gemma3_text.Model:
    mx.random.seed(seed)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(TINY_GEMMA))
    mx.eval(model.parameters())
    return model
