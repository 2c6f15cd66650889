import pytest

from omlx_cache import models


@pytest.fixture(scope="session")
def smollm2_dirs():
    """(4-bit, float32) SmolLM2-135M-Instruct model directories, built if missing."""
    return models.import_model(models.MODELS["smollm2"], models.REPO_ROOT / "models")
