"""The bench's models: a llama with random weights at a preset's real shape,
in the patched mlx-lm and in the pristine one (upstream's tree, imported as
``mlx_lm_pristine``) with the same parameter arrays."""

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx_lm.models import llama

from .common import log

REPO_ROOT = Path(__file__).resolve().parents[2]
VENDOR = REPO_ROOT / "vendor"
PRISTINE = "mlx_lm_pristine"


LLAMA_DEFAULTS = {"model_type": "llama", "rms_norm_eps": 1e-5, "rope_theta": 10000.0}

# Random weights at real shapes: speed and memory do not depend on the values.
PRESETS = {
    "llama3-8b": {
        "config": {
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 128256,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
        },
        "dtype": "float16",
        "weights": (64, 4),
        "contexts": (4096, 16384, 32768),
    },
    "smollm2": {
        "config": {
            "hidden_size": 576,
            "num_hidden_layers": 30,
            "intermediate_size": 1536,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "vocab_size": 49152,
            "rope_theta": 100000.0,
            "tie_word_embeddings": True,
        },
        "dtype": "float16",
        "weights": None,
        "contexts": (1024, 4096),
    },
    # Gemma 3 270M's shape in a llama block (every layer full attention).
    "gemma3-270m": {
        "config": {
            "hidden_size": 640,
            "num_hidden_layers": 18,
            "intermediate_size": 2048,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "vocab_size": 262144,
            "tie_word_embeddings": True,
        },
        "dtype": "float16",
        "weights": None,
        "contexts": (1024, 4096),
    },
    # float32: on the CPU, quantized matmul is about 40x slower in float16.
    # Two layers and four query heads keep the default run to a few minutes.
    "tiny-cpu": {
        "config": {
            "hidden_size": 256,
            "num_hidden_layers": 2,
            "intermediate_size": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "vocab_size": 1024,
            "tie_word_embeddings": True,
        },
        "dtype": "float32",
        "weights": None,
        "contexts": (1024, 2048, 4096),
    },
}


# --- upstream (unpatched) mlx-lm -------------------------------------------


def extract_pristine(root: Path = VENDOR / "pristine"):
    """Extract mlx-lm's pristine sdist (tag ``upstream``) into ``root``."""
    if (root / "mlx_lm" / "__init__.py").exists():
        return root
    log(f"bench: {root} is missing: extracting upstream mlx-lm (tag 'upstream') there")
    root.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(VENDOR / "mlx-lm"), "archive", "upstream", "mlx_lm"],
        check=True,
        capture_output=True,
    )
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    return root


def import_pristine(root: Path = VENDOR / "pristine"):
    """The pristine ``models.llama`` and ``models.cache``, imported as
    ``mlx_lm_pristine``. The package's ``__init__`` is not run: it loads the
    generation and conversion code, which the models do not need."""
    if PRISTINE not in sys.modules:
        package = extract_pristine(root) / "mlx_lm"
        spec = importlib.util.spec_from_file_location(
            PRISTINE,
            package / "__init__.py",
            submodule_search_locations=[str(package)],
        )
        sys.modules[PRISTINE] = importlib.util.module_from_spec(spec)
    pristine_llama = importlib.import_module(f"{PRISTINE}.models.llama")
    pristine_cache = importlib.import_module(f"{PRISTINE}.models.cache")
    return pristine_llama, pristine_cache


def pristine_version(root: Path = VENDOR / "pristine") -> str | None:
    path = root / "mlx_lm" / "_version.py"
    text = path.read_text() if path.exists() else ""
    found = re.search(r"__version__ = [\"'](.+)[\"']", text)
    return found and found.group(1)


# --- models ------------------------------------------------------------------


def model_args(module, preset: dict):
    return module.ModelArgs.from_dict({**LLAMA_DEFAULTS, **preset["config"]})


def finish_module(module: nn.Module, dtype, weights):
    """Cast (and quantize) one module's random weights and evaluate them, so
    the float32 originals of only this module exist at a time."""
    module.set_dtype(dtype)
    if weights is not None:
        group_size, bits = weights
        nn.quantize(
            module,
            group_size=group_size,
            bits=bits,
            class_predicate=lambda _, m: isinstance(m, (nn.Linear, nn.Embedding)),
        )
    mx.eval(module.parameters())


def build_model(preset: dict, dtype, seed: int = 0):
    """The patched llama at ``preset``'s shape, with random weights."""
    mx.random.seed(seed)
    model = llama.Model(model_args(llama, preset))
    for layer in model.model.layers:
        finish_module(layer, dtype, preset["weights"])
    finish_module(model, dtype, preset["weights"])
    return model


def build_models(preset: dict, dtype, seed: int = 0):
    """The patched and the pristine llama with one set of weights."""
    ours = build_model(preset, dtype, seed)
    pristine_llama, _ = import_pristine()
    upstream = pristine_llama.Model(model_args(pristine_llama, preset))
    if preset["weights"] is not None:
        group_size, bits = preset["weights"]
        nn.quantize(upstream, group_size=group_size, bits=bits)
    upstream.update(ours.parameters())
    return ours, upstream


def lm_head(model, hidden):
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)
