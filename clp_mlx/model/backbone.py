"""The backbone: mlx-lm's Qwen2 model, with the pieces the decode step needs.

One forward pass gives the final (normed) hidden states; the output projection
turns any stack of hidden states, backbone or head, into logits in one matmul.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import ClpError
from ..native.padrows import pad_rows
from .checks import qwen2_config

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def default_dtype() -> str:
    """fp32 on the CPU backend, fp16 on a GPU.

    On a CPU only fp32 matmuls go through BLAS (100+ GFLOP/s with OpenBLAS);
    fp16/bf16 run at 2-4 GFLOP/s. On a GPU, fp16 halves the bytes each pass
    reads, and a decode step is bound by memory bandwidth.
    """
    return "float32" if mx.default_device() == mx.cpu else "float16"


def load_backbone(path: str | Path, dtype: str | None = None):
    """Load an MLX model folder with mlx-lm; cast float weights to ``dtype``.

    ``dtype`` None keeps the folder's own dtype, as mlx-lm does (so greedy
    tokens are mlx-lm's), except that float weights are cast to fp32 on the
    CPU backend (see :func:`default_dtype`); quantized weights keep theirs.

    A folder mlx-lm cannot load (a foreign or broken config.json, missing or
    truncated weights, a broken tokenizer) is refused with a ClpError naming it.
    """
    from mlx_lm import load as mlx_load

    path = Path(path)
    if dtype is not None and dtype not in DTYPES:
        raise ClpError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    check_config(path)
    try:
        model, tokenizer = mlx_load(str(path), lazy=True)
    except Exception as e:  # mlx-lm and transformers raise types of their own, too
        raise ClpError(f"cannot load the model folder {path}: {_reason(e)}") from e
    words, rows = len(getattr(tokenizer, "_tokenizer", ())), token_count(model)
    if words > rows:  # its ids past the model's tables would read beyond them
        raise ClpError(f"{path}: the tokenizer has {words} tokens, the model only {rows}")
    if dtype is None and not quantization(model) and mx.default_device() == mx.cpu:
        dtype = "float32"
    if dtype is not None:
        model.set_dtype(DTYPES[dtype])
    try:
        mx.eval(model.parameters())
    except LOAD_ERRORS as e:  # the weights are read here
        raise ClpError(f"cannot read the weights in {path}: {_reason(e)}") from e
    pad_rows(model)
    return model, tokenizer


# What MLX raises for weights it cannot read: a truncated or foreign file
# (RuntimeError), a missing one, bad sizes.
LOAD_ERRORS = (
    OSError, ValueError, TypeError, KeyError, AttributeError, IndexError, AssertionError,
    RuntimeError, RecursionError, ArithmeticError,
)  # fmt: skip


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def check_config(path: Path) -> dict:
    """The folder's config.json, refused unless it describes a Qwen2 model."""
    file = path / "config.json"
    if not file.is_file():
        raise ClpError(f"{path} is not a model folder (no config.json)")
    try:
        config = json.loads(file.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ClpError(f"cannot read {file}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError too
        raise ClpError(f"{file} is not valid JSON ({_reason(e)})") from None
    qwen2_config(config, str(file))
    layers = _weight_layers(path)
    if config.get("num_hidden_layers", 0) > layers:
        raise ClpError(
            f"{file} says {config['num_hidden_layers']} layers; the weights hold {layers}"
        )
    return config


def _weight_layers(path: Path) -> int:
    """How many transformer layers the weight files hold (their headers only)."""
    files, found = sorted(path.glob("model*.safetensors")), set()
    if not files:
        raise ClpError(f"{path} holds no weights (model*.safetensors)")
    for f in files:
        try:
            names = mx.load(str(f)).keys()  # lazy: reads the header
        except LOAD_ERRORS as e:
            raise ClpError(f"cannot read the weights {f}: {_reason(e)}") from None
        found |= {n.split(".")[2] for n in names if n.startswith("model.layers.")}
    return len(found)


def token_count(model: nn.Module) -> int:
    """How many token ids the model can take and give: the rows of its
    embedding table and of its output projection."""
    return min(model.model.embed_tokens.weight.shape[0], output_layer(model).weight.shape[0])


def context_length(model: nn.Module) -> int | None:
    """The most positions the model was made for (``max_position_embeddings``)."""
    return getattr(model.args, "max_position_embeddings", None)


def hidden_states(model: nn.Module, tokens: mx.array, cache) -> mx.array:
    """Final-norm hidden states, (len(tokens), hidden), for a 1-D token array."""
    return model.model(tokens[None], cache=cache)[0]


def project(model: nn.Module, h: mx.array) -> mx.array:
    """The backbone's output projection (tied embedding or lm_head).

    Rows of another dtype (heads kept in fp32 on an fp16 or quantized
    backbone) are cast to the projection's: the few rows, never the
    vocabulary-sized weight, which a mixed-dtype matmul would convert on
    every call."""
    dtype = output_dtype(model)
    if h.dtype != dtype and mx.issubdtype(h.dtype, mx.floating):
        h = h.astype(dtype)
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(h)
    return model.lm_head(h)


def output_layer(model: nn.Module) -> nn.Module:
    """The layer that projects to logits: the tied embedding or lm_head
    (float or quantized)."""
    return model.model.embed_tokens if model.args.tie_word_embeddings else model.lm_head


def is_quantized_output(model: nn.Module) -> bool:
    return isinstance(output_layer(model), (nn.QuantizedEmbedding, nn.QuantizedLinear))


def quantization(model: nn.Module) -> str:
    """The quantized layers' bits and group sizes, e.g. "4-bit/64" (several,
    comma-separated, if they differ); "" for float weights. What the dtype
    of the float parts does not tell: pass times and greedy tokens differ."""
    kinds = {
        (m.bits, m.group_size, getattr(m, "mode", "affine"))
        for _, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    }
    return ",".join(
        f"{b}-bit/{g}" + ("" if mode == "affine" else f" {mode}") for b, g, mode in sorted(kinds)
    )


def output_dtype(model: nn.Module) -> mx.Dtype:
    """The float dtype the output projection computes in: its weight's, or
    a quantized layer's scales'."""
    layer = output_layer(model)
    return layer.scales.dtype if is_quantized_output(model) else layer.weight.dtype


def output_rows(model: nn.Module, ids: mx.array | None = None) -> mx.array:
    """Rows ``ids`` (None: all) of the (vocab, hidden) output projection, in
    :func:`output_dtype`. A quantized layer's rows are dequantized, only
    those rows (their packed weights, scales and biases), as its embedding
    lookup does: the values its own matmul computes with, up to summation
    order. Prefer a slice: the whole of a quantized layer is a float copy."""
    layer = output_layer(model)
    if not is_quantized_output(model):
        return layer.weight if ids is None else layer.weight[ids]
    pick = (lambda a: a) if ids is None else (lambda a: a[ids])
    biases = layer.get("biases")
    return mx.dequantize(
        pick(layer.weight),
        scales=pick(layer.scales),
        biases=None if biases is None else pick(biases),
        group_size=layer.group_size,
        bits=layer.bits,
        mode=getattr(layer, "mode", "affine"),
    )


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
