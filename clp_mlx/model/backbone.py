"""The backbone: mlx-lm's Qwen2 model, with the pieces the decode step needs.

One forward pass gives the final (normed) hidden states; the output projection
turns any stack of hidden states, backbone or head, into logits in one matmul.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import ClpError
from ..native.padrows import pad_rows

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def default_dtype() -> str:
    """fp32 on the CPU backend, fp16 on a GPU.

    On a CPU only fp32 matmuls go through BLAS (100+ GFLOP/s with OpenBLAS);
    fp16/bf16 run at 2-4 GFLOP/s. On a GPU, fp16 halves the bytes each pass
    reads, and a decode step is bound by memory bandwidth.
    """
    return "float32" if mx.default_device() == mx.cpu else "float16"


def load_backbone(path: str | Path, dtype: str | None = None):
    """Load an MLX model folder with mlx-lm; cast float weights to ``dtype``."""
    from mlx_lm import load as mlx_load

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ClpError(f"{path} is not a model folder (no config.json)")
    dtype = dtype or default_dtype()
    if dtype not in DTYPES:
        raise ClpError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    model, tokenizer = mlx_load(str(path), lazy=True)
    if getattr(model, "model_type", None) != "qwen2":
        raise ClpError(f"{path}: model_type {model.model_type!r} is not qwen2")
    model.set_dtype(DTYPES[dtype])
    mx.eval(model.parameters())
    pad_rows(model)
    return model, tokenizer


def hidden_states(model: nn.Module, tokens: mx.array, cache) -> mx.array:
    """Final-norm hidden states, (len(tokens), hidden), for a 1-D token array."""
    return model.model(tokens[None], cache=cache)[0]


def project(model: nn.Module, h: mx.array) -> mx.array:
    """The backbone's output projection (tied embedding or lm_head)."""
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(h)
    return model.lm_head(h)


def _output_layer(model: nn.Module):
    return model.model.embed_tokens if model.args.tie_word_embeddings else model.lm_head


def is_quantized_output(model: nn.Module) -> bool:
    return isinstance(_output_layer(model), (nn.QuantizedEmbedding, nn.QuantizedLinear))


def output_weight(model: nn.Module) -> mx.array:
    """The (vocab, hidden) output projection matrix of a float backbone."""
    if is_quantized_output(model):
        raise ClpError("this needs a float backbone; convert without -q")
    return _output_layer(model).weight


def embed(model: nn.Module, tokens: mx.array) -> mx.array:
    return model.model.embed_tokens(tokens)


def signature(model: nn.Module) -> dict:
    """Shape facts plus a small probe of the weights that identifies a backbone.

    The probe is 256 values sampled from the embedding table and the final
    norm. Heads are matched to a backbone by cosine similarity of probes, so
    the same weights in fp32, fp16 or MLX-quantized form still match, while a
    different checkpoint does not. ``fingerprint`` is a short digest for people.
    """
    args = model.args
    rows = mx.linspace(0, args.vocab_size - 1, 24).astype(mx.int32)
    cols = mx.linspace(0, args.hidden_size - 1, 8).astype(mx.int32)
    emb = embed(model, rows)[:, cols].reshape(-1)
    norm = model.model.norm.weight[mx.linspace(0, args.hidden_size - 1, 64).astype(mx.int32)]
    probe = mx.concatenate([emb, norm]).astype(mx.float32)
    values = [round(float(v), 5) for v in probe.tolist()]
    digest = hashlib.sha256(repr([round(v, 2) for v in values]).encode()).hexdigest()
    return {
        "hidden_size": args.hidden_size,
        "vocab_size": args.vocab_size,
        "num_layers": args.num_hidden_layers,
        "fingerprint": digest[:16],
        "probe": values,
    }
