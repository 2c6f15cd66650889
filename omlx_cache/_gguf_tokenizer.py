"""Build Hugging Face tokenizer files from the tokenizer held in GGUF metadata.

Two GGUF tokenizer models are supported: ``gpt2`` (byte-level BPE with merges)
and ``llama`` (SentencePiece BPE: pieces with scores and byte fallback, as in
Gemma), both turned into a ``tokenizers`` BPE model.
"""

import json
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

# llama.cpp's token types (gguf.TokenType)
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# SentencePiece's whitespace symbol
SPM_SPACE = "\u2581"

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
    """A ``tokenizers.Tokenizer`` equivalent to the GGUF's tokenizer."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        return _byte_level_tokenizer(metadata)
    if kind == "llama":
        return _sentencepiece_tokenizer(metadata)
    raise ValueError(f"Unsupported GGUF tokenizer model: {kind!r}")


def _byte_level_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """GGUF ``gpt2``: byte-level BPE with the merges stored in the file."""
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


def sentencepiece_merges(
    tokens: list[str], scores: list[float], token_types: list[int]
) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's BPE from its scored pieces.

    SentencePiece (and llama.cpp's ``llama`` tokenizer) repeatedly joins the
    adjacent pair of symbols whose concatenation is the best scored piece,
    the leftmost pair on ties. Ranking every split ``(left, right)`` of every
    normal piece by that piece's score turns it into a standard BPE: the
    lowest ranked merge is the best scored piece, and BPE too takes the
    leftmost pair on ties.
    """
    vocab = set(tokens)
    ranked = []
    for token_id, (token, kind) in enumerate(zip(tokens, token_types)):
        if kind != TOKEN_NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[token_id], token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """GGUF ``llama``: SentencePiece BPE with byte fallback.

    llama.cpp replaces spaces with ``\u2581`` (after an optional leading
    one), and splits user-defined pieces (runs of newlines, HTML tags in
    Gemma) off the raw text first, as added tokens do here.
    """
    tokens = list(metadata["tokenizer.ggml.tokens"])
    scores = _as_python(metadata["tokenizer.ggml.scores"])
    token_types = _as_python(metadata["tokenizer.ggml.token_type"])
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    unk_id = _token_id(metadata, "tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab=vocab,
        merges=sentencepiece_merges(tokens, scores, token_types),
        unk_token=None if unk_id is None else tokens[unk_id],
        fuse_unk=True,
        byte_fallback=True,
    )

    tokenizer = Tokenizer(model)
    replace = normalizers.Replace(" ", SPM_SPACE)
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if _space_prefix(metadata):
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPM_SPACE), replace]
        )
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        tokenizer.normalizer = replace
    tokenizer.decoder = decoders.Sequence(steps)
    bos_id = _token_id(metadata, "tokenizer.ggml.bos_token_id")
    add_bos = _as_python(metadata.get("tokenizer.ggml.add_bos_token", True))
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    tokenizer.add_tokens(_added_tokens(tokens, token_types))
    return tokenizer


def _space_prefix(metadata: dict[str, Any]) -> bool:
    """llama.cpp adds a leading space for ``llama`` tokenizers unless told not to."""
    return bool(_as_python(metadata.get("tokenizer.ggml.add_space_prefix", True)))


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
    # llama.cpp's defaults when the keys are missing: a BOS for ``llama`` only
    spm = metadata.get("tokenizer.ggml.model") == "llama"
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", spm)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_as_python(add_bos)),
        "add_eos_token": bool(_as_python(metadata.get("tokenizer.ggml.add_eos_token"))),
        "add_prefix_space": spm and _space_prefix(metadata),
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
