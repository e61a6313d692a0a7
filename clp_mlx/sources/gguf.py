"""Convert a Qwen2 GGUF file (llama.cpp's format) into an MLX model folder.

The result is what ``mlx_lm.convert`` writes for a Hugging Face checkpoint:
``config.json``, safetensors weights, ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json``, so that both
``mlx_lm.load`` and ``transformers.AutoTokenizer`` open it.

Every tensor is dequantized with the ``gguf`` package (plain numpy).
``mx.load`` can read GGUF files too, but it returns wrong values for some
k-quants and cannot read Q5_0 at all, so it is never used here.

llama.cpp stores Qwen2's Q and K projections in Hugging Face row order (Qwen2
uses NEOX-style rotary embeddings, so the converter has no reason to permute
them the way it does for llama), hence weights are copied without reordering.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import TokenType
from mlx.utils import tree_flatten
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
from clp_mlx.paths import atomic_folder

DTYPES = {"float16": mx.float16, "float32": mx.float32, "bfloat16": mx.bfloat16}
Q_BITS = (4, 8)
Q_GROUP_SIZES = (32, 64, 128)

# Tensor types the gguf package dequantizes with vectorised numpy; the IQ
# families need slow grid look-ups and Qwen's official files do not use them.
_TYPE_NAMES = "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K"
SUPPORTED_TYPES = frozenset(QType[name] for name in _TYPE_NAMES.split())

# llama.cpp tensor name -> mlx-lm (Hugging Face) parameter name; {i} is the
# block index.
NAME_TEMPLATES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

# The same split Qwen2's own tokenizer.json applies before byte-level BPE.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Instruct models end a turn with <|im_end|>, base models a document with
# <|endoftext|>; Qwen's generation_config.json stops on both.
QWEN2_END_TOKENS = ("<|im_end|>", "<|endoftext|>")

MAX_SHARD_GB = 2


def open_gguf(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    """Open ``path`` with ``gguf.GGUFReader``; any failure becomes a ClpError."""
    path = Path(path)
    if not path.is_file():
        raise ClpError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError, KeyError, IndexError...
        raise ClpError(
            f"{path} is not a readable GGUF file (truncated or corrupt? {exc})"
        ) from None


def _meta(reader: gguf.GGUFReader, key: str, default: Any = ...) -> Any:
    """One metadata value; a missing key without a default is a ClpError."""
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ClpError(f"GGUF metadata has no {key!r}")
        return default
    return field.contents()


def gguf_config(reader: gguf.GGUFReader, dtype: str = "float16") -> dict[str, Any]:
    """The Hugging Face / mlx-lm ``config.json`` for a qwen2 GGUF file."""
    arch = _meta(reader, "general.architecture")
    if arch != "qwen2":
        raise ClpError(f"unsupported GGUF architecture {arch!r}: only 'qwen2' can be converted")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ClpError("GGUF file has no token_embd.weight tensor")
    # GGUF lists dimensions fastest-first: ne = (hidden, vocab) for the embedding.
    vocab_size = int(tensors["token_embd.weight"].shape[-1])
    context = int(_meta(reader, "qwen2.context_length"))
    config: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": int(_meta(reader, "qwen2.embedding_length")),
        "intermediate_size": int(_meta(reader, "qwen2.feed_forward_length")),
        "num_hidden_layers": int(_meta(reader, "qwen2.block_count")),
        "num_attention_heads": int(_meta(reader, "qwen2.attention.head_count")),
        "num_key_value_heads": int(_meta(reader, "qwen2.attention.head_count_kv")),
        "max_position_embeddings": context,
        "rms_norm_eps": float(_meta(reader, "qwen2.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_meta(reader, "qwen2.rope.freq_base", 1_000_000.0)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "use_sliding_window": False,
        "torch_dtype": dtype,
    }
    scaling = _meta(reader, "qwen2.rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        config["rope_scaling"] = {
            "type": scaling,
            "factor": float(_meta(reader, "qwen2.rope.scaling.factor")),
            "original_max_position_embeddings": int(
                _meta(reader, "qwen2.rope.scaling.original_context_length", context)
            ),
        }
    elif scaling != "none":
        raise ClpError(f"unsupported rope scaling type {scaling!r}")
    for key in ("bos", "eos", "padding"):
        token_id = _meta(reader, f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(token_id)
    return config


def mlx_tensor_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name to its mlx-lm name, or raise ClpError."""
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    key = f"blk.{{i}}.{match.group(2)}" if match else gguf_name
    template = NAME_TEMPLATES.get(key)
    if template is None:
        raise ClpError(f"unknown GGUF tensor {gguf_name!r}")
    return template.format(i=match.group(1)) if match else template


def _check_supported(tensor: gguf.ReaderTensor) -> None:
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise ClpError(
            f"tensor {tensor.name!r} has GGUF type {tensor.tensor_type.name}, which this converter does not support"
        )


def dequantize_tensor(tensor: gguf.ReaderTensor) -> np.ndarray:
    """A GGUF tensor as float32 numpy in row-major (numpy/mlx) shape."""
    _check_supported(tensor)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return values.reshape(shape).astype(np.float32, copy=False)


def gguf_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """Rebuild Qwen2's byte-level BPE ``tokenizers.Tokenizer`` from GGUF metadata."""
    model = _meta(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ClpError(
            f"unsupported GGUF tokenizer model {model!r}: expected byte-level BPE ('gpt2')"
        )
    pre = _meta(reader, "tokenizer.ggml.pre", "qwen2")
    if pre != "qwen2":
        raise ClpError(f"unsupported GGUF pre-tokenizer {pre!r}: only Qwen2's ('qwen2') is known")
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    merges = _meta(reader, "tokenizer.ggml.merges")
    types = _meta(reader, "tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))

    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)  # a duplicate string cannot get a second id
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


def _tokenizer_config(
    reader: gguf.GGUFReader, tokenizer: Tokenizer, context: int
) -> dict[str, Any]:
    def token(key: str) -> str | None:
        token_id = _meta(reader, f"tokenizer.ggml.{key}_token_id", None)
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
    template = _meta(reader, "tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return config


def _generation_config(config: dict[str, Any], tokenizer: Tokenizer) -> dict[str, Any]:
    eos = [config["eos_token_id"]] if "eos_token_id" in config else []
    for token in QWEN2_END_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None and token_id not in eos:
            eos.append(token_id)
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": eos}
    if "pad_token_id" in config:
        generation["pad_token_id"] = config["pad_token_id"]
    return generation


def _empty_model(config: dict[str, Any]) -> Any:
    """An mlx-lm Qwen2 model whose parameters are still unevaluated (free)."""
    from mlx_lm.models import qwen2  # mlx_lm pulls in transformers: import only when converting

    return qwen2.Model(qwen2.ModelArgs.from_dict(config))


def _plan(reader: gguf.GGUFReader, expected: dict[str, tuple[int, ...]]) -> list[tuple[Any, str]]:
    """Pair each GGUF tensor with its mlx name; check names, types and shapes first."""
    plan = []
    for tensor in reader.tensors:
        name = mlx_tensor_name(tensor.name)
        _check_supported(tensor)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if name not in expected:
            raise ClpError(f"GGUF tensor {tensor.name!r} does not fit the model config")
        if shape != expected[name]:
            raise ClpError(
                f"GGUF tensor {tensor.name!r} has shape {shape}, the config implies {expected[name]}"
            )
        plan.append((tensor, name))
    missing = sorted(set(expected) - {name for _, name in plan})
    if missing:
        raise ClpError(f"GGUF file lacks {len(missing)} tensor(s), e.g. {missing[0]}")
    return plan


def _save_weights(folder: Path, weights: dict[str, mx.array]) -> None:
    """Write safetensors, split into ~2 GB shards with an index when large."""
    from mlx_lm.utils import make_shards

    shards = make_shards(weights, max_file_size_gb=MAX_SHARD_GB)
    if len(shards) == 1:
        mx.save_safetensors(str(folder / "model.safetensors"), shards[0], {"format": "mlx"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(folder / file_name), shard, {"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(v.nbytes for v in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(folder / "model.safetensors.index.json", index)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: str = "float16",
    q_bits: int | None = None,
    q_group_size: int = 64,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Convert a qwen2 GGUF file into an MLX model folder and return its path.

    Args:
        gguf_path: the ``.gguf`` file (any of the types in ``SUPPORTED_TYPES``).
        out_dir: the folder to create; it must not exist unless ``force``.
        dtype: ``float16``, ``float32`` or ``bfloat16`` for the written weights.
        q_bits: 4 or 8 to re-quantize with MLX's affine quantization (as
            ``mlx_lm.convert -q`` does), ``None`` to keep ``dtype`` weights.
        q_group_size: MLX quantization group size (32, 64 or 128).
        force: replace an existing ``out_dir``.
        progress: show a tqdm bar while dequantizing.

    The folder appears only when complete: everything is written into a
    hidden ``.<out_dir>.partial-*`` sibling (:func:`clp_mlx.paths.atomic_folder`)
    that is renamed at the end and removed on any failure, Ctrl-C included.
    """
    if dtype not in DTYPES:
        raise ClpError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if q_bits is not None and q_bits not in Q_BITS:
        raise ClpError(f"unsupported quantization bits {q_bits}; choose 4 or 8")
    if q_bits is not None and q_group_size not in Q_GROUP_SIZES:
        raise ClpError(f"unsupported quantization group size {q_group_size}; choose 32, 64 or 128")
    out = Path(os.path.abspath(out_dir))  # normalized, so "." or "x/" still has a name
    if out.exists() and not force:
        raise ClpError(f"output folder {out} already exists (use --force to replace it)")

    # Everything cheap and checkable happens before the slow dequantization.
    reader = open_gguf(gguf_path)
    config = gguf_config(reader, dtype)
    tokenizer = gguf_tokenizer(reader)
    if tokenizer.get_vocab_size(with_added_tokens=True) > config["vocab_size"]:
        raise ClpError("GGUF vocabulary has more tokens than the embedding has rows")
    model = _empty_model(config)
    expected = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}
    plan = _plan(reader, expected)

    with atomic_folder(out) as tmp:
        weights = _convert_tensors(plan, DTYPES[dtype], progress)
        if q_bits is not None:
            from mlx_lm.utils import quantize_model

            model.load_weights(list(weights.items()), strict=True)
            weights.clear()  # the model holds the only reference now
            model, config = quantize_model(model, config, q_group_size, q_bits)
            weights = dict(tree_flatten(model.parameters()))
            del model
        _save_weights(tmp, weights)
        del weights
        _write_json(tmp / "config.json", dict(sorted(config.items())))
        _write_json(tmp / "generation_config.json", _generation_config(config, tokenizer))
        _write_json(
            tmp / "tokenizer_config.json",
            _tokenizer_config(reader, tokenizer, config["max_position_embeddings"]),
        )
        tokenizer.save(str(tmp / "tokenizer.json"))
    return out


def _convert_tensors(
    plan: list[tuple[Any, str]], dtype: mx.Dtype, progress: bool
) -> dict[str, mx.array]:
    """Dequantize tensor by tensor, so only one float32 copy is alive at a time."""
    from tqdm import tqdm

    weights: dict[str, mx.array] = {}
    for tensor, name in tqdm(plan, desc="dequantizing", unit="tensor", disable=not progress):
        values = dequantize_tensor(tensor)
        weights[name] = mx.array(values).astype(dtype)
        mx.eval(weights[name])  # materialize now so the numpy buffer can go
        del values
    return weights
