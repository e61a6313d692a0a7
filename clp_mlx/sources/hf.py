"""Convert a Hugging Face Qwen2 folder into an MLX model folder.

The source is what ``huggingface-cli download Qwen/Qwen2.5-...`` leaves on disk:
``config.json``, tokenizer files and weights as ``*.safetensors`` or
``pytorch_model*.bin`` (one file, or shards listed in an ``*.index.json``).
The result is what ``mlx_lm.convert`` writes and ``mlx_lm.load`` reads.

Hugging Face and mlx-lm name Qwen2's weights alike and store linear layers in
the same (out, in) layout, so no tensor is renamed or transposed; mlx-lm's own
``sanitize``, ``quantize_model``, ``save_model`` and ``save_config`` do the rest.
``.bin`` files are read with :mod:`clp_mlx.sources.torch_zip`, which needs no
torch and runs no code from the file.  Tokenizer files are copied unchanged.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx

from clp_mlx.errors import ClpError
from clp_mlx.model.checks import json_kind
from clp_mlx.paths import atomic_folder
from clp_mlx.sources.converting import (
    Choices,
    check_output,
    empty_qwen2,
    load_and_quantize,
    read_json,
    write_marker,
    writing,
)
from clp_mlx.sources.torch_zip import load_torch_file

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
Q_BITS = (2, 3, 4, 5, 6, 8)
Q_GROUP_SIZES = (32, 64, 128)
# Errors list the choices as a tuple: "choose from (2, 3, 4, 5, 6, 8)".
_CHOICES = Choices(DTYPES, Q_BITS, Q_GROUP_SIZES, spell=lambda c: f"from {c}")

# Files copied as they are: everything a tokenizer or generation needs.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def _read_config(src: Path) -> dict[str, Any]:
    if not (src / "config.json").is_file():
        raise ClpError(f"{src} is not a Hugging Face model folder (no config.json)")
    path = inside(src, "config.json", "config")
    config = read_json(path, "config")
    if not isinstance(config, dict):
        raise ClpError(f"{path} must hold a JSON object, not {json_kind(config)}")
    if config.get("model_type") != "qwen2":
        raise ClpError(
            f"{src}: model_type {config.get('model_type')!r} is not supported (only qwen2)"
        )
    if "quantization" in config or "quantization_config" in config:
        raise ClpError(f"{src} is already quantized; convert an unquantized checkpoint")
    return config


def _weight_files(src: Path) -> list[Path]:
    """The weight files of ``src``, safetensors preferred; index files are honoured."""
    for index_name, pattern in (
        ("model.safetensors.index.json", "model*.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
    ):
        index = src / index_name
        if index.is_file():
            names = _shard_names(inside(src, index_name, "weight index"))
            paths = [inside(src, n, f"shard listed in {index_name}") for n in names]
            missing = [n for n, path in zip(names, paths) if not path.is_file()]
            if missing:
                raise ClpError(
                    f"{src}: shard(s) listed in {index_name} are missing: {', '.join(missing)}"
                )
            return paths
        files = [inside(src, f.name, "weight file") for f in sorted(src.glob(pattern))]
        if files:
            return files
    raise ClpError(f"{src} holds no weights (model*.safetensors or pytorch_model*.bin)")


def _shard_names(index: Path) -> list[str]:
    """The distinct shard file names an ``*.index.json`` maps the weights to."""
    weight_map = read_json(index, "weight index")
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ClpError(f"{index} is not a valid weight index (no weight_map of file names)")
    return sorted(set(weight_map.values()))


def _roots(src: Path) -> list[Path]:
    """Where the files of ``src`` may really be: the folder, and for a Hugging
    Face cache snapshot (files are links to ``../../blobs``) the repo's blobs."""
    real = src.resolve()
    return [real, real.parent.parent / "blobs"] if real.parent.name == "snapshots" else [real]


def inside(src: Path, name: str, what: str) -> Path:
    """``src / name``, refused unless it names a file inside ``src`` (no absolute
    path, no ``..``, no link to elsewhere: an index or a link must not make the
    converter read, and copy into its output, a file outside the model)."""
    rel = Path(name)
    if not name or "\0" in name or rel.is_absolute() or ".." in rel.parts:
        raise ClpError(f"{src}: the {what} {name!r} is not a file name inside the model folder")
    path = src / rel
    try:
        real = path.resolve()
    except (OSError, RuntimeError) as e:  # a loop of links
        raise ClpError(f"{src}: the {what} {name!r} cannot be followed ({e})") from None
    if not any(real == root or root in real.parents for root in _roots(src)):
        raise ClpError(f"{src}: the {what} {name!r} points outside the model folder (to {real})")
    return path


def _load_weights(files: list[Path], dtype: mx.Dtype) -> dict[str, mx.array]:
    """Read every shard, casting float tensors to ``dtype`` shard by shard."""
    weights: dict[str, mx.array] = {}
    for f in files:
        if f.suffix == ".safetensors":
            try:
                shard = mx.load(str(f))
            except (RuntimeError, ValueError) as e:
                raise ClpError(f"{f}: cannot read safetensors ({e})") from None
        else:
            shard = {k: mx.array(v) for k, v in load_torch_file(f).items()}
        for name, value in shard.items():
            if name in weights:
                raise ClpError(f"{name} appears in more than one weight file")
            if mx.issubdtype(value.dtype, mx.floating):
                value = value.astype(dtype)
            weights[name] = value
        mx.eval(list(weights.values()))  # free this shard's source buffers now
    return weights


def _check_names(weights: dict[str, mx.array], model: Any) -> None:
    from mlx.utils import tree_flatten

    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    missing = sorted(set(expected) - set(weights))
    unknown = sorted(set(weights) - set(expected))
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} (e.g. {', '.join(missing[:3])})")
        if unknown:
            parts.append(f"unexpected {len(unknown)} (e.g. {', '.join(unknown[:3])})")
        raise ClpError(f"weights do not fit the config: {'; '.join(parts)}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ClpError(
                f"{name} has shape {tuple(weights[name].shape)}, the config implies {shape}"
            )


def _tokenizer_files(src: Path) -> list[str]:
    present = [n for n in TOKENIZER_FILES if (src / n).is_file() and inside(src, n, "tokenizer file")]
    if not {"tokenizer.json", "vocab.json", "tokenizer.model"} & set(present):
        raise ClpError(f"{src} holds no tokenizer (tokenizer.json, or vocab.json + merges.txt)")
    return present


def convert_hf(
    src_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: str = "float16",
    q_bits: int | None = None,
    q_group_size: int = 64,
    force: bool = False,
) -> Path:
    """Convert a Hugging Face Qwen2 folder into an MLX model folder; return its path.

    Args:
        src_dir: folder with ``config.json``, tokenizer files and weights
            (``model*.safetensors`` or ``pytorch_model*.bin``, sharded or not).
        out_dir: folder to create; it must not exist unless ``force``.
        dtype: ``float16``, ``bfloat16`` or ``float32`` for the written weights.
        q_bits: quantize with MLX's affine quantization to this many bits
            (2, 3, 4, 5, 6 or 8), as ``mlx_lm.convert -q`` does; ``None`` keeps
            ``dtype`` weights.
        q_group_size: quantization group size (32, 64 or 128).
        force: replace an existing ``out_dir``.

    The output appears only when complete: it is written into a hidden sibling
    folder that is renamed at the end and removed on any failure, Ctrl-C included.
    Raises :class:`ClpError` for anything wrong with the input or the options.
    """
    _CHOICES.check(dtype, q_bits, q_group_size)
    src = Path(src_dir)
    if not src.is_dir():
        raise ClpError(f"{src} is not a folder")
    out = check_output(out_dir, force, [src])

    # Cheap checks first: a bad folder fails before any weight is read.
    config = _read_config(src)
    files = _weight_files(src)
    tokenizer_files = _tokenizer_files(src)
    model = _empty_model(src, config)
    from mlx_lm.utils import save_config, save_model  # heavy: only once the checks passed

    options = {"dtype": dtype, "q_bits": q_bits, "q_group_size": q_group_size}
    with writing(out), atomic_folder(out) as tmp:
        for name in tokenizer_files:
            shutil.copyfile(src / name, tmp / name)
        weights = model.sanitize(_load_weights(files, DTYPES[dtype]))
        _check_names(weights, model)
        model, config = load_and_quantize(model, weights, config, q_bits, q_group_size)
        save_model(tmp, model, donate_model=True)
        save_config(dict(config), tmp / "config.json")
        write_marker(tmp, "hf", src.resolve(), **options)
    return out


def _empty_model(src: Path, config: dict[str, Any]) -> Any:
    """The mlx-lm model ``config`` describes; a config it cannot build is the user's to fix."""
    return empty_qwen2(config, f"{src}/config.json")
