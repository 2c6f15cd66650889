"""The offline hub cache stand-in for mlx-community/Qwen1.5-0.5B-Chat-4bit."""

import pytest
from mlx import nn

from omlx_cache import models, standin


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub")
    standin.build(cache, models.REPO_ROOT / "models")
    return cache


def test_layout(hub_cache):
    storage = standin.repo_folder(hub_cache, standin.REPO_ID)
    commit = (storage / "refs" / "main").read_text()
    snapshot = storage / "snapshots" / commit
    files = standin.read_files(snapshot)
    assert commit == standin.commit_hash(files)
    for path in snapshot.iterdir():
        assert path.is_symlink() and not path.readlink().is_absolute()
        blob = path.resolve()
        assert blob.parent == (storage / "blobs").resolve()
        assert blob.name == standin.sha256_bytes(files[path.name])
    assert {"config.json", "model.safetensors.index.json", "README.md"} <= set(files)


def test_rebuild_is_identical(hub_cache):
    storage = standin.repo_folder(hub_cache, standin.REPO_ID)
    before = (storage / "refs" / "main").read_text()
    standin.build(hub_cache, models.REPO_ROOT / "models")
    assert (storage / "refs" / "main").read_text() == before
    assert len(list((storage / "snapshots").iterdir())) == 1


def test_hub_accepts_it(hub_cache):
    from huggingface_hub import scan_cache_dir, snapshot_download

    path = snapshot_download(
        standin.REPO_ID, cache_dir=hub_cache, local_files_only=True
    )
    assert path.endswith(
        (standin.repo_folder(hub_cache, standin.REPO_ID) / "refs" / "main").read_text()
    )
    info = scan_cache_dir(hub_cache)
    assert not info.warnings
    assert [r.repo_id for r in info.repos] == [standin.REPO_ID]


def test_loads_as_quantized_qwen2(hub_cache):
    from huggingface_hub import snapshot_download
    from mlx_lm import load
    from mlx_lm.models.qwen2 import Model

    path = snapshot_download(
        standin.REPO_ID, cache_dir=hub_cache, local_files_only=True
    )
    model, tokenizer = load(path)
    assert isinstance(model, Model)
    up_proj = model.layers[0].mlp.up_proj
    assert isinstance(up_proj, nn.QuantizedLinear)
    assert (up_proj.bits, up_proj.group_size) == (4, 64)
    assert model.args.hidden_size // model.args.num_attention_heads == 64
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
