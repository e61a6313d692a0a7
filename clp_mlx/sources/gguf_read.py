"""Read a Qwen2 GGUF file (llama.cpp's format): its config, tensor names and values.

Every tensor is dequantized with the ``gguf`` package (plain numpy).
``mx.load`` can read GGUF files too, but it returns wrong values for some
k-quants and cannot read Q5_0 at all, so it is never used here.

llama.cpp stores Qwen2's Q and K projections in Hugging Face row order (Qwen2
uses NEOX-style rotary embeddings, so the converter has no reason to permute
them the way it does for llama), hence weights are copied without reordering.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from clp_mlx.errors import ClpError

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


def meta(reader: gguf.GGUFReader, key: str, default: Any = ...) -> Any:
    """One metadata value; a missing key without a default is a ClpError."""
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ClpError(f"GGUF metadata has no {key!r}")
        return default
    return field.contents()


def _whole(reader: gguf.GGUFReader, key: str) -> int:
    """An integer metadata value; a string, float or list there is a ClpError."""
    value = meta(reader, key)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ClpError(f"GGUF metadata {key} must be an integer, not {value!r:.40}")
    return int(value)


def _number(reader: gguf.GGUFReader, key: str, default: Any = ...) -> float:
    value = meta(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise ClpError(f"GGUF metadata {key} must be a number, not {value!r:.40}")
    return float(value)


def gguf_config(reader: gguf.GGUFReader, dtype: str = "float16") -> dict[str, Any]:
    """The Hugging Face / mlx-lm ``config.json`` for a qwen2 GGUF file; metadata
    of the wrong kind (a string for a size, say) is a ClpError."""
    try:
        return _config(reader, dtype)
    except (TypeError, ValueError, OverflowError, IndexError) as e:
        raise ClpError(f"GGUF metadata of the wrong kind ({e})") from None


def _config(reader: gguf.GGUFReader, dtype: str) -> dict[str, Any]:
    arch = meta(reader, "general.architecture")
    if arch != "qwen2":
        raise ClpError(f"unsupported GGUF architecture {arch!r}: only 'qwen2' can be converted")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ClpError("GGUF file has no token_embd.weight tensor")
    # GGUF lists dimensions fastest-first: ne = (hidden, vocab) for the embedding.
    vocab_size = int(tensors["token_embd.weight"].shape[-1])
    context = _whole(reader, "qwen2.context_length")
    config: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": _whole(reader, "qwen2.embedding_length"),
        "intermediate_size": _whole(reader, "qwen2.feed_forward_length"),
        "num_hidden_layers": _whole(reader, "qwen2.block_count"),
        "num_attention_heads": _whole(reader, "qwen2.attention.head_count"),
        "num_key_value_heads": _whole(reader, "qwen2.attention.head_count_kv"),
        "max_position_embeddings": context,
        "rms_norm_eps": _number(reader, "qwen2.attention.layer_norm_rms_epsilon"),
        "rope_theta": _number(reader, "qwen2.rope.freq_base", 1_000_000.0),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "use_sliding_window": False,
        "torch_dtype": dtype,
    }
    config.update(_rope_scaling(reader, context))
    for key in ("bos", "eos", "padding"):
        token_id = meta(reader, f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(token_id)
    return config


def _rope_scaling(reader: gguf.GGUFReader, context: int) -> dict[str, Any]:
    """The config's ``rope_scaling`` entry, or nothing when the file uses none."""
    scaling = meta(reader, "qwen2.rope.scaling.type", "none")
    if scaling == "none":
        return {}
    if scaling not in ("linear", "yarn"):
        raise ClpError(f"unsupported rope scaling type {scaling!r}")
    return {
        "rope_scaling": {
            "type": scaling,
            "factor": _number(reader, "qwen2.rope.scaling.factor"),
            "original_max_position_embeddings": int(
                meta(reader, "qwen2.rope.scaling.original_context_length", context)
            ),
        }
    }


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


def tensor_plan(
    reader: gguf.GGUFReader, expected: dict[str, tuple[int, ...]]
) -> list[tuple[gguf.ReaderTensor, str]]:
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
