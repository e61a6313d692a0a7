"""Convert a Qwen2 GGUF file (llama.cpp's format) into an MLX model folder.

The result is what ``mlx_lm.convert`` writes for a Hugging Face checkpoint:
``config.json``, safetensors weights, ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json``, so that both
``mlx_lm.load`` and ``transformers.AutoTokenizer`` open it.

Reading and dequantizing live in :mod:`clp_mlx.sources.gguf_read`, the
tokenizer files in :mod:`clp_mlx.sources.gguf_tokenizer`; this module checks
everything it can before the slow part, then dequantizes and writes the folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import Tokenizer

from clp_mlx.errors import ClpError
from clp_mlx.paths import atomic_folder
from clp_mlx.sources.converting import (
    Choices,
    check_output,
    empty_qwen2,
    load_and_quantize,
    write_marker,
    writing,
)
from clp_mlx.sources.gguf_read import dequantize_tensor, gguf_config, open_gguf, tensor_plan
from clp_mlx.sources.gguf_tokenizer import generation_config, gguf_tokenizer, tokenizer_config

DTYPES = {"float16": mx.float16, "float32": mx.float32, "bfloat16": mx.bfloat16}
Q_BITS = (4, 8)
Q_GROUP_SIZES = (32, 64, 128)
# Errors list the choices in words: "choose 4 or 8", "choose 32, 64 or 128".
_CHOICES = Choices(DTYPES, Q_BITS, Q_GROUP_SIZES,
                   spell=lambda c: f"{', '.join(map(str, c[:-1]))} or {c[-1]}")

MAX_SHARD_GB = 2


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
        gguf_path: the ``.gguf`` file (any of the types in
            :data:`clp_mlx.sources.gguf_read.SUPPORTED_TYPES`).
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
    _CHOICES.check(dtype, q_bits, q_group_size)
    out = check_output(out_dir, force, [Path(gguf_path)])
    reader, config, tokenizer, model, plan = _checked_source(gguf_path, dtype)

    options = {"dtype": dtype, "q_bits": q_bits, "q_group_size": q_group_size}
    with writing(out), atomic_folder(out) as tmp:
        weights = _convert_tensors(plan, DTYPES[dtype], progress)
        if q_bits is not None:
            model, config = load_and_quantize(model, weights, config, q_bits, q_group_size)
            weights = dict(tree_flatten(model.parameters()))
            del model
        _save_weights(tmp, weights)
        del weights
        _write_json(tmp / "config.json", dict(sorted(config.items())))
        _write_json(tmp / "generation_config.json", generation_config(config, tokenizer))
        _write_json(
            tmp / "tokenizer_config.json",
            tokenizer_config(reader, tokenizer, config["max_position_embeddings"]),
        )
        tokenizer.save(str(tmp / "tokenizer.json"))
        write_marker(tmp, "gguf", Path(gguf_path), **options)
    return out


def _checked_source(
    gguf_path: str | os.PathLike[str], dtype: str
) -> tuple[gguf.GGUFReader, dict[str, Any], Tokenizer, Any, list[tuple[Any, str]]]:
    """Everything cheap and checkable, done before the slow dequantization:
    the reader, the config, the tokenizer, an empty model and the tensor plan."""
    reader = open_gguf(gguf_path)
    config = gguf_config(reader, dtype)
    tokenizer = gguf_tokenizer(reader)
    if tokenizer.get_vocab_size(with_added_tokens=True) > config["vocab_size"]:
        raise ClpError("GGUF vocabulary has more tokens than the embedding has rows")
    model = empty_qwen2(config, f"{gguf_path}: the GGUF metadata")
    expected = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}
    return reader, config, tokenizer, model, tensor_plan(reader, expected)


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
