"""Rebuild Qwen2's tokenizer files from a GGUF file's metadata.

A GGUF file carries the vocabulary, the BPE merges, the token types and the
chat template, but not ``tokenizer.json``: the pieces Qwen2's own tokenizer
adds around them (pre-tokenizing split, byte-level mapping, NFC) are written
back here, so ``transformers.AutoTokenizer`` and mlx-lm tokenize exactly as
with Qwen's original files.
"""

from __future__ import annotations

from typing import Any

import gguf
from gguf import TokenType
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from clp_mlx.errors import ClpError
from clp_mlx.sources.gguf_read import meta

# The same split Qwen2's own tokenizer.json applies before byte-level BPE.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Instruct models end a turn with <|im_end|>, base models a document with
# <|endoftext|>; Qwen's generation_config.json stops on both.
QWEN2_END_TOKENS = ("<|im_end|>", "<|endoftext|>")


def gguf_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """Rebuild Qwen2's byte-level BPE ``tokenizers.Tokenizer`` from GGUF metadata."""
    model = meta(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ClpError(
            f"unsupported GGUF tokenizer model {model!r}: expected byte-level BPE ('gpt2')"
        )
    pre = meta(reader, "tokenizer.ggml.pre", "qwen2")
    if pre != "qwen2":
        raise ClpError(f"unsupported GGUF pre-tokenizer {pre!r}: only Qwen2's ('qwen2') is known")
    tokens = meta(reader, "tokenizer.ggml.tokens")
    types = meta(reader, "tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)  # a duplicate string cannot get a second id
    tokenizer = _byte_level_bpe(vocab, meta(reader, "tokenizer.ggml.merges"))

    # Control tokens (<|im_start|>...) are special; user-defined ones
    # (<tool_call>...) are matched whole but kept when decoding with
    # skip_special_tokens, exactly as in Qwen's own tokenizer.json.
    added = [
        AddedToken(tokens[i], special=t == TokenType.CONTROL, normalized=False)
        for i, t in enumerate(types)
        if t in (TokenType.CONTROL, TokenType.USER_DEFINED)
    ]
    tokenizer.add_tokens(added)
    for token in added:
        if tokenizer.token_to_id(token.content) != vocab[token.content]:
            raise ClpError(f"added token {token.content!r} did not keep its GGUF id")
    return tokenizer


def _byte_level_bpe(vocab: dict[str, int], merges: list[str]) -> Tokenizer:
    """The BPE model with Qwen2's normalizer, pre-tokenizer, decoder and post-processor."""
    pairs = [tuple(merge.split(" ")) for merge in merges]
    if any(len(pair) != 2 for pair in pairs):
        raise ClpError("GGUF tokenizer.ggml.merges has an entry that is not two tokens")
    try:
        tokenizer = Tokenizer(
            models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
        )
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own Exception type
        raise ClpError(f"GGUF tokenizer metadata is inconsistent ({exc})") from None
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    return tokenizer


def tokenizer_config(
    reader: gguf.GGUFReader, tokenizer: Tokenizer, context: int
) -> dict[str, Any]:
    """``tokenizer_config.json``: Qwen2's settings, special tokens and chat template."""
    def token(key: str) -> str | None:
        token_id = meta(reader, f"tokenizer.ggml.{key}_token_id", None)
        return None if token_id is None else tokenizer.id_to_token(int(token_id))

    config: dict[str, Any] = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,  # Qwen2 never prepends a BOS token
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": context,
        "split_special_tokens": False,
    }
    template = meta(reader, "tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return config


def generation_config(config: dict[str, Any], tokenizer: Tokenizer) -> dict[str, Any]:
    """``generation_config.json``: stop on the config's eos and on both Qwen2 end tokens."""
    eos = [config["eos_token_id"]] if "eos_token_id" in config else []
    for token in QWEN2_END_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None and token_id not in eos:
            eos.append(token_id)
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": eos}
    if "pad_token_id" in config:
        generation["pad_token_id"] = config["pad_token_id"]
    return generation
