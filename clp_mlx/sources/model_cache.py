"""Converted models in the cache: written whole or not at all, found with a few ``stat`` calls.

Every conversion goes to a hidden temporary sibling that is renamed into place
only once complete, so a folder in the cache is always whole and a cached model
resolves without hashing anything. Folder names carry a :func:`fingerprint` of
the source where the source may change under the same name.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

from ..errors import ClpError
from ..paths import atomic_folder


def fingerprint(files: list[Path]) -> str:
    """A short key that changes when any file is replaced or edited."""
    stats = [(file.name, file.stat()) for file in files]
    text = "\n".join(f"{name}:{st.st_size}:{st.st_mtime_ns}" for name, st in stats)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def is_complete(folder: Path) -> bool:
    """A cache folder is whole once it exists (it is renamed into place last); check cheaply."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def converted(out: Path, convert: Callable[[Path], Path]) -> Path:
    """``out`` as it is when complete, else run ``convert`` into a private
    temporary sibling (it creates the folder itself) and rename the finished
    folder to ``out``."""
    if is_complete(out):
        return out
    if out.is_symlink():
        raise ClpError(f"{out} is a link to an incomplete model folder; remove the link")
    if out.is_dir():
        shutil.rmtree(out)  # not something this module wrote; it would block the rename
    try:
        with atomic_folder(out, create=False, replace=False) as tmp:
            convert(tmp)
    except FileExistsError:
        if not is_complete(out):  # another process may have finished the same folder first
            raise
    return out


def convert_gguf_file(gguf: Path, out: Path, dtype: str, progress: bool) -> Path:
    from .gguf import convert_gguf  # heavy (mlx, gguf): only when converting

    return Path(convert_gguf(gguf, out, dtype=dtype, force=False, progress=progress))


def convert_hf_folder(src: Path, out: Path, dtype: str) -> Path:
    from .hf import convert_hf  # heavy (mlx, mlx_lm): only when converting

    return Path(convert_hf(src, out, dtype=dtype, force=False))
