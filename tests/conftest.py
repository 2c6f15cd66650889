import pytest

from omlx_cache import models


@pytest.fixture(scope="session")
def smollm2_dirs():
    """(4-bit, float32) SmolLM2-135M-Instruct model directories, built if missing."""
    return models.import_model(models.MODELS["smollm2"], models.REPO_ROOT / "models")


@pytest.fixture(scope="session")
def smollm2_f32(smollm2_dirs):
    """The float32 SmolLM2-135M-Instruct (model, tokenizer)."""
    from mlx_lm import load

    return load(str(smollm2_dirs[1]))


@pytest.fixture(scope="session")
def smollm2_prefill(smollm2_f32):
    """Each layer's (keys, values, queries, scale) of the float32 SmolLM2's
    one-chunk prefill of ``kv_model_runs.PROMPT`` through its own caches."""
    from kv_model_runs import PROMPT, record_prefill

    model, tokenizer = smollm2_f32
    return record_prefill(model, tokenizer.encode(PROMPT))


@pytest.fixture(scope="session")
def gemma3_f32_model():
    """The float32 Gemma-3-270M, built if missing (the model alone: its
    tokenizer takes seconds to load)."""
    from mlx_lm.utils import load_model

    dirs = models.import_model(models.MODELS["gemma3"], models.REPO_ROOT / "models")
    return load_model(dirs[1])[0]
