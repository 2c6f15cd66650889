"""Build Hugging Face tokenizer files from the tokenizer held in GGUF metadata.

Only GGUF's ``gpt2`` tokenizer model (byte-level BPE) is supported so far.
"""

import json
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)

# llama.cpp's token types (gguf.TokenType)
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# llama.cpp pre-tokenizer names that split every digit before the GPT-2 regex
_DIGIT_SPLITTING_PRE = {"smollm", "starcoder", "refact", "codeshell"}


def _as_python(value):
    """Turn an MLX scalar or array from ``mx.load(..., return_metadata=True)``
    into a plain Python value."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


# how GGUF names the special token ids, and how Hugging Face names the tokens
_SPECIAL_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _token_id(metadata: dict[str, Any], key: str):
    value = metadata.get(key)
    return None if value is None else int(_as_python(value))


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=False, trim_offsets=True, use_regex=True
    )
    if pre not in _DIGIT_SPLITTING_PRE:
        return byte_level
    digits = pre_tokenizers.Digits(individual_digits=True)
    return pre_tokenizers.Sequence([digits, byte_level])


def _added_tokens(tokens: list[str], token_types: list[int]) -> list[AddedToken]:
    added = []
    for token, token_type in zip(tokens, token_types):
        if token_type in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            added.append(AddedToken(token, special=True, normalized=False))
        elif token_type == TOKEN_USER_DEFINED:
            added.append(AddedToken(token, special=False, normalized=False))
    return added


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` equivalent to the GGUF's byte-level BPE."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"Unsupported GGUF tokenizer model: {kind!r}")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    token_types = _as_python(metadata["tokenizer.ggml.token_type"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", ""))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_tokens(_added_tokens(tokens, token_types))
    return tokenizer


def special_tokens(metadata: dict[str, Any]) -> dict[str, str]:
    """The bos/eos/unk/pad tokens named in the metadata, as strings."""
    tokens = metadata["tokenizer.ggml.tokens"]
    named = {}
    for name, key in _SPECIAL_KEYS.items():
        token_id = _token_id(metadata, key)
        if token_id is not None:
            named[name] = tokens[token_id]
    return named


def tokenizer_config(metadata: dict[str, Any], max_length: int) -> dict[str, Any]:
    """The ``tokenizer_config.json`` contents for the GGUF's tokenizer."""
    tokens = metadata["tokenizer.ggml.tokens"]
    token_types = _as_python(metadata["tokenizer.ggml.token_type"])
    control = [t for t, k in zip(tokens, token_types) if k == TOKEN_CONTROL]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_as_python(metadata.get("tokenizer.ggml.add_bos_token"))),
        "add_eos_token": bool(_as_python(metadata.get("tokenizer.ggml.add_eos_token"))),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "additional_special_tokens": control,
        **special_tokens(metadata),
    }
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def write_tokenizer(metadata: dict[str, Any], out_dir: Path, max_length: int):
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    out_dir = Path(out_dir)
    build_tokenizer(metadata).save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(metadata, max_length)
    special = special_tokens(metadata)
    special["additional_special_tokens"] = config["additional_special_tokens"]
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", special)


def _write_json(path: Path, content: dict[str, Any]):
    with open(path, "w", encoding="utf-8") as fid:
        json.dump(content, fid, indent=2, ensure_ascii=False)
        fid.write("\n")
