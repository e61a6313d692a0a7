"""Where clp-mlx keeps its files, and the one way it writes them.

Every file or folder the project writes appears under its final name only
when it is complete: it is written to a temporary sibling first and renamed
into place (a rename within one folder is atomic on POSIX). An interrupted
run leaves at most a hidden ``.NAME.partial-*`` sibling, never a half-written
file under the real name. Nothing here imports MLX: the native stage uses
it before ``mlx.core`` is loaded.
"""

from __future__ import annotations

import errno
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
def atomic_folder(folder: str | Path, *, create: bool = True, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling of ``folder`` to fill; on success it takes the
    name, on any error (Ctrl-C included) it is removed.

    ``create=False`` yields the sibling's path without making it, for writers
    that insist on creating their folder (the converters refuse an existing
    one); it is ``.NAME.partial-<pid>``, one per process, so a run finds and
    clears what a killed run of the same process id left.
    ``replace=False`` keeps a folder that holds the name by the end (another
    process finished first) and raises FileExistsError after removing ours.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    if create:
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent))
    else:
        tmp = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
        _remove(tmp)
    try:
        yield tmp
        _into_place(tmp, folder, replace)
    except BaseException:
        _remove(tmp)
        raise


def _into_place(tmp: Path, folder: Path, replace: bool) -> None:
    """Rename ``tmp`` to ``folder``. An old ``folder`` is renamed aside first and
    deleted after: deleting in place, cut short, would leave half a folder
    under the name. If the rename fails, the old one is put back."""
    old = None
    if replace and (folder.exists() or folder.is_symlink()):
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        folder.rename(old)
    try:
        os.rename(tmp, folder)
    except OSError as err:
        if old is not None:
            old.rename(folder)
        elif folder.exists():  # a non-empty folder: ENOTEMPTY, not EEXIST, on Linux
            raise FileExistsError(errno.EEXIST, "already exists", str(folder)) from err
        raise
    if old is not None:
        _remove(old)


def _remove(path: Path) -> None:
    """Delete a file, link or folder (a link, not what it points to); quietly if absent."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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


@contextmanager
def scratch_folder(path: str | Path, tag: str) -> Iterator[Path]:
    """Yield a private temporary folder next to ``path`` for the work towards it
    (wheels, a download: same filesystem, so results move by rename), removed
    afterwards whatever happens. Nothing in it is ever renamed to ``path`` by
    this: publish with :func:`atomic_file`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{path.name}.{tag}-", dir=path.parent))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_file`)."""
    return write_bytes(path, text.encode(encoding))
