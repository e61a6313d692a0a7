"""Tiny Qwen2-shaped GGUF files for the converter tests, written with gguf.GGUFWriter.

The model has 2 layers, hidden size 64, 4 heads of 16 and 2 KV heads; the
tokenizer is a byte-level BPE with 256 byte tokens, a dozen merges, Qwen's
three control tokens, one user-defined token and unused padding rows.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import TokenType

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 2, 64, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
CONTEXT = 512

MERGES = [
    "h e",
    "l l",
    "he ll",
    "hell o",  # hello
    "Ġ w",
    "o r",
    "l d",
    "Ġw or",
    "Ġwor ld",  # " world"
    "Ġ t",
    "Ġt he",  # " the"
    "Ġ Ġ",  # two spaces
]
SPECIALS = [
    ("<|endoftext|>", TokenType.CONTROL),
    ("<|im_start|>", TokenType.CONTROL),
    ("<|im_end|>", TokenType.CONTROL),
    ("<tool_call>", TokenType.USER_DEFINED),
]
VOCAB_ROWS = 288  # unused tokens pad the vocabulary to the embedding rows, as in Qwen's files
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte value 0..255."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def vocab_tokens() -> tuple[list[str], list[int]]:
    """Token strings and llama.cpp token types, index = token id."""
    tokens = byte_alphabet() + [merge.replace(" ", "") for merge in MERGES]
    types = [TokenType.NORMAL] * len(tokens)
    for text, kind in SPECIALS:
        tokens.append(text)
        types.append(kind)
    while len(tokens) < VOCAB_ROWS:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(TokenType.UNUSED)
    return tokens, [int(t) for t in types]


# mlx-lm name -> llama.cpp name, written out independently of the converter.
def _gguf_name(hf_name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    parts = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
    }
    if rest in parts:
        return f"blk.{i}.{parts[rest]}"
    module, proj, kind = rest.split(".")
    short = proj.split("_")[0]
    return f"blk.{i}.{'attn' if module == 'self_attn' else 'ffn'}_{short}.{kind}"


def model_tensors(tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights keyed by mlx-lm name, in (out, in) shape."""
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB_ROWS, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB_ROWS, HIDDEN)
    kv = KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (HIDDEN,),
                p + "post_attention_layernorm.weight": (HIDDEN,),
                p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
                p + "self_attn.q_proj.bias": (HIDDEN,),
                p + "self_attn.k_proj.weight": (kv, HIDDEN),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, HIDDEN),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                p + "mlp.gate_proj.weight": (FFN, HIDDEN),
                p + "mlp.up_proj.weight": (FFN, HIDDEN),
                p + "mlp.down_proj.weight": (HIDDEN, FFN),
            }
        )
    tensors = {}
    for name, shape in shapes.items():
        base = 1.0 if "norm" in name else 0.0
        tensors[name] = (base + 0.05 * rng.standard_normal(shape)).astype(np.float32)
    return tensors


HPARAMS = {
    "block_count": LAYERS,
    "context_length": CONTEXT,
    "embedding_length": HIDDEN,
    "feed_forward_length": FFN,
    "attention.head_count": HEADS,
    "attention.head_count_kv": KV_HEADS,
    "rope.freq_base": 10000.0,
    "attention.layer_norm_rms_epsilon": 1e-6,
}


def _add_value(writer: gguf.GGUFWriter, key: str, value: object) -> None:
    """One metadata entry, typed by its Python type (None: left out)."""
    if value is None:
        return
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        (writer.add_int64 if value < 0 or value >= 2**32 else writer.add_uint32)(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "qwen2",
    tied: bool = True,
    qtype: QType = QType.F32,
    tokenizer: bool = True,
    extra_tensors: dict[str, np.ndarray] | None = None,
    hparams: dict[str, object] | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny GGUF to ``path``; returns the float32 source weights by mlx-lm name.

    ``qtype`` applies to the 2-D matrices; norms and biases stay F32 as in
    llama.cpp's quantized files. The returned values are the exact ones the
    file decodes to (already round-tripped through ``qtype``). ``hparams``
    overrides hyperparameters by key without the architecture prefix
    (``{"attention.head_count": 0}``), of any type: hostile files.
    """
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {**HPARAMS, **(hparams or {})}.items():
        _add_value(writer, f"{arch}.{key}", value)
    if tokenizer:
        tokens, types = vocab_tokens()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(MERGES)
        writer.add_bos_token_id(tokens.index("<|endoftext|>"))
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_pad_token_id(tokens.index("<|endoftext|>"))
        writer.add_chat_template(CHAT_TEMPLATE)

    decoded = {}
    for name, values in model_tensors(tied).items():
        if values.ndim == 2 and qtype == QType.F16:  # numpy float16 is written as F16
            writer.add_tensor(_gguf_name(name), values.astype(np.float16))
            decoded[name] = values.astype(np.float16).astype(np.float32)
        elif values.ndim == 2 and qtype != QType.F32:
            packed = gguf.quants.quantize(values, qtype)
            writer.add_tensor(_gguf_name(name), packed, raw_dtype=qtype)
            decoded[name] = gguf.quants.dequantize(packed, qtype).reshape(values.shape)
        else:
            writer.add_tensor(_gguf_name(name), values)
            decoded[name] = values
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded
