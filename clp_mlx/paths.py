"""Where clp-mlx keeps its files, and the one way it writes them.

Every file or folder the project writes appears under its final name only
when it is complete: it is written to a temporary sibling first and renamed
into place (a rename within one folder is atomic on POSIX). An interrupted
run leaves at most a hidden ``.NAME.partial-*`` sibling, never a half-written
file under the real name. Nothing here imports MLX: the native stage uses
it before ``mlx.core`` is loaded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def cache_root() -> Path:
    """Where downloads and conversions are kept: ``$CLP_MLX_HOME``, else ``~/.cache/clp_mlx``."""
    home = os.environ.get("CLP_MLX_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "clp_mlx"


@contextmanager
def atomic_folder(folder: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``folder``; on success it replaces ``folder``,
    on any error it is removed: no half-written folder ever has the name."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent))
    try:
        yield tmp
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path of ``path`` to write; on success it is
    renamed to ``path``, on any error removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return Path(path)
