"""An offline Hugging Face hub cache with a stand-in for upstream's test model.

Upstream mlx-lm's tests load ``mlx-community/Qwen1.5-0.5B-Chat-4bit`` from the
hub. This writes a hub cache holding a tiny random ``qwen2`` model under that
id, 4-bit quantized like the real one, with SmolLM2's byte-level BPE tokenizer
and a ChatML chat template, so the tests run with

    HF_HUB_OFFLINE=1 HF_HUB_CACHE=models/hub

The files are deterministic and the snapshot's commit hash is derived from
their contents, so rebuilding gives the same cache.

    python -m omlx_cache.standin --out models/hub
"""

import argparse
import contextlib
import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from . import _gguf_tokenizer, models

REPO_ID = "mlx-community/Qwen1.5-0.5B-Chat-4bit"
SEED = 0
INIT_STD = 0.02
# logits of std ~8, so that the random model, like a trained one, puts most
# of its probability on a few tokens and sampling at temperature < 1 is stable
HEAD_STD = 0.5

# Qwen1.5's ChatML template: a default system prompt, then one
# <|im_start|>role ... <|im_end|> block per message
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MODEL_CARD = """---
library_name: mlx
license: apache-2.0
pipeline_tag: text-generation
tags:
- mlx
---

# Stand-in for mlx-community/Qwen1.5-0.5B-Chat-4bit

A tiny random `qwen2` model (2 layers, hidden 256, 4-bit, group 64) with SmolLM2-135M's byte-level
BPE tokenizer, written by `python -m omlx_cache.standin` so that mlx-lm's
tests run offline. Its outputs are meaningless.
"""


def log(message: str):
    print(f"[omlx_cache.standin] {message}", file=sys.stderr, flush=True)


def tiny_qwen2_config(vocab_size: int, eos_token_id: int) -> dict:
    """Qwen1.5's shape (head_dim 64, no GQA, untied head, q/k/v bias), scaled
    down. head_dim 64 lets the KV cache quantize with group size 64."""
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": vocab_size,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def random_model(config: dict, seed: int = SEED):
    """A qwen2 model with float32 weights drawn from a fixed numpy seed:
    normal(0, INIT_STD) for matrices and biases (HEAD_STD for the output
    head), ones for the norms."""
    from mlx_lm.models import qwen2

    model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    rng = np.random.default_rng(seed)
    params = []
    for name, value in sorted(tree_flatten(model.parameters())):
        if name.endswith("norm.weight"):
            new = np.ones(value.shape, dtype=np.float32)
        else:
            std = HEAD_STD if name.startswith("lm_head") else INIT_STD
            new = rng.normal(0.0, std, size=value.shape).astype(np.float32)
        params.append((name, mx.array(new)))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def standin_metadata(metadata: dict) -> dict:
    """SmolLM2's GGUF tokenizer metadata with Qwen1.5's special tokens:
    no bos or unk, eos <|im_end|>, pad <|endoftext|>, a ChatML template."""
    tokens = metadata["tokenizer.ggml.tokens"]
    dropped = ("bos_token_id", "unknown_token_id")
    standin = {k: v for k, v in metadata.items() if k.rsplit(".", 1)[-1] not in dropped}
    standin["tokenizer.ggml.eos_token_id"] = tokens.index("<|im_end|>")
    standin["tokenizer.ggml.padding_token_id"] = tokens.index("<|endoftext|>")
    standin["tokenizer.ggml.add_bos_token"] = False
    standin["tokenizer.chat_template"] = CHATML_TEMPLATE
    return standin


def write_standin_model(out_dir: Path, metadata: dict):
    """Write the stand-in's model directory (what the hub repo holds)."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    metadata = standin_metadata(metadata)
    eos_token_id = metadata["tokenizer.ggml.eos_token_id"]
    config = tiny_qwen2_config(len(metadata["tokenizer.ggml.tokens"]), eos_token_id)
    model = random_model(config)
    with contextlib.redirect_stdout(sys.stderr):
        model, config = quantize_model(model, config, group_size=64, bits=4)
    save_model(out_dir, model)
    save_config(config, config_path=out_dir / "config.json")
    _gguf_tokenizer.write_tokenizer(metadata, out_dir, max_length=32768)
    (out_dir / "README.md").write_text(MODEL_CARD)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def commit_hash(files: dict) -> str:
    """A 40-hex commit id derived from the file names and contents."""
    digest = hashlib.sha1()
    for name in sorted(files):
        digest.update(f"{name}\0{sha256_bytes(files[name])}\n".encode())
    return digest.hexdigest()


def repo_folder(cache_dir: Path, repo_id: str) -> Path:
    return Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def write_hub_repo(cache_dir: Path, repo_id: str, files: dict) -> Path:
    """Lay ``files`` (name -> bytes) out as a hub cache snapshot of
    ``repo_id``: blobs named by sha256, relative symlinks, refs/main.
    Other snapshots of the repo and their blobs are removed."""
    storage = repo_folder(cache_dir, repo_id)
    commit = commit_hash(files)
    blobs, snapshot = storage / "blobs", storage / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    kept = set()
    for name, data in sorted(files.items()):
        blob = blobs / sha256_bytes(data)
        kept.add(blob.name)
        if not blob.exists():
            partial = blob.with_suffix(".incomplete")
            partial.write_bytes(data)
            partial.replace(blob)
        link = snapshot / name
        target = Path("..", "..", "blobs", blob.name)
        if link.is_symlink() and Path(link.readlink()) == target:
            continue
        link.unlink(missing_ok=True)
        link.symlink_to(target)
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    _remove_stale(storage, commit, kept)
    return snapshot


def _remove_stale(storage: Path, commit: str, kept: set):
    for old in (storage / "snapshots").iterdir():
        if old.name != commit:
            shutil.rmtree(old)
    for blob in (storage / "blobs").iterdir():
        if blob.name not in kept:
            blob.unlink()


def read_files(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


def build(cache_dir: Path, models_root: Path = models.REPO_ROOT / "models") -> Path:
    """Write (or refresh) the stand-in repo in ``cache_dir``; its snapshot path."""
    _, metadata = models.gguf_for("smollm2", models_root)
    with tempfile.TemporaryDirectory() as tmp:
        write_standin_model(Path(tmp), metadata)
        files = read_files(tmp)
    snapshot = write_hub_repo(cache_dir, REPO_ID, files)
    log(f"{REPO_ID} -> {snapshot}")
    return snapshot


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m omlx_cache.standin",
        description=f"Write an offline hub cache holding a stand-in for {REPO_ID}.",
    )
    parser.add_argument("--out", default="models/hub", help="hub cache folder")
    parser.add_argument(
        "--models", default="models", help="where the GGUF download is cached"
    )
    args = parser.parse_args(argv)
    build(Path(args.out), Path(args.models))


if __name__ == "__main__":
    main()
