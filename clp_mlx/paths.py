"""Where clp-mlx keeps its files, and the one way it writes them.

Every file or folder the project writes appears under its final name only
when it is complete: it is written to a temporary sibling first and renamed
into place (a rename within one folder is atomic on POSIX). An interrupted
run leaves at most a hidden sibling named ``.NAME.<kind>-<pid>[-<random>]``
(kind ``partial``, ``old`` or a scratch tag), never a half-written file under
the real name; :func:`sweep`, which every writer here calls first, removes those
no live process owns. Nothing here imports MLX (the native stage needs it first).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

# .NAME.<kind>-<pid>[-<random>]: what the writers below name their temporaries.
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<kind>[a-z]+)-(?P<pid>\d{1,9})(?:-[A-Za-z0-9_]+)?$")
# .NAME.<kind>-<8 random characters>: what older versions named theirs (no pid).
_LEGACY = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|wheels|hub)-[a-z0-9_]{8}$")
KINDS = frozenset({"partial", "old", "wheels", "hub"})
LEGACY_AGE_S = 24 * 3600  # a pid-less temporary untouched this long is stale
_swept: set[tuple[str, str | None]] = set()


def cache_root() -> Path:
    """Where downloads and conversions are kept: ``$CLP_MLX_HOME``, else ``~/.cache/clp_mlx``."""
    home = os.environ.get("CLP_MLX_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "clp_mlx"


@contextmanager
def atomic_folder(
    folder: str | Path, *, create: bool = True, replace: bool = True,
    ours: Callable[[Path], bool] | None = None,
) -> Iterator[Path]:
    """Yield a temporary sibling of ``folder`` to fill; on success it takes the
    name (with the permissions the user's umask gives a new folder), on any
    error (Ctrl-C included) it is removed.

    ``create=False`` yields the sibling's path without making it, for writers
    that insist on creating their folder (the converters refuse an existing
    one); it is ``.NAME.partial-<pid>``.
    ``replace=False`` keeps a folder that holds the name by the end (another
    process finished first) and raises FileExistsError after removing ours.
    An existing ``folder`` is replaced only if :func:`replace_refusal` allows
    it (never a file, a link, the current or home folder; not a non-empty
    folder that ``ours`` does not recognise): FileExistsError saying why.
    """
    folder = Path(os.path.abspath(folder))  # so that "." has a name
    why = replace_refusal(folder, ours or (lambda _: True)) if replace else None
    if why is not None:
        raise FileExistsError(errno.EEXIST, f"refusing to replace it: {why}", str(folder))
    _prepare(folder)
    if create:
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-{os.getpid()}-", dir=folder.parent))
    else:
        tmp = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
        _remove(tmp)
    try:
        with _held(tmp if create else None):
            yield tmp
            if create:
                os.chmod(tmp, 0o777 & ~umask())  # mkdtemp made it 0700
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
        _remove(old)
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
    _prepare(path)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def scratch_folder(path: str | Path, tag: str) -> Iterator[Path]:
    """Yield a private temporary folder next to ``path`` (``tag``: one of
    :data:`KINDS`) for the work towards it, removed afterwards whatever
    happens; publish the result with :func:`atomic_file`."""
    path = Path(path)
    if tag not in KINDS:
        raise ValueError(f"scratch tag {tag!r} is not one of {sorted(KINDS)}")
    _prepare(path)
    work = Path(tempfile.mkdtemp(prefix=f".{path.name}.{tag}-{os.getpid()}-", dir=path.parent))
    try:
        with _held(work):
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


def umask() -> int:
    """The process's umask, read without changing it where Linux tells it."""
    with suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # no /proc: set and restore
    os.umask(mask)
    return mask


def _prepare(path: Path) -> None:
    """Make ``path``'s folder and clear what killed runs left there: temporaries of
    ``path`` itself, and in the cache every stale temporary of the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep(path.parent, None if _in_cache(path.parent) else path.name, once=True)


def _in_cache(folder: Path) -> bool:
    root, real = _real(cache_root()), _real(folder)
    return real == root or root in real.parents


def sweep(folder: str | Path, name: str | None = None, *, once: bool = False) -> list[Path]:
    """Remove the temporaries (see the module docstring) in ``folder`` that no
    live process owns, only those of ``name`` when given; return them.

    A temporary is stale when its pid is dead, or alive but started after the
    temporary was last written (a reused pid), and nobody holds its lock; one
    without a pid (older versions) when untouched for a day. An ``old`` one
    (the previous output, renamed aside while the new one took its place) is
    renamed back if nothing holds the name, else removed. ``once``: skip a
    folder this process already swept."""
    folder = Path(folder)
    if once and (str(folder), name) in _swept:
        return []
    _swept.add((str(folder), name))
    try:
        entries = [Path(e.path) for e in os.scandir(folder) if e.name.startswith(".")]
    except OSError:
        return []
    gone = []
    for path in entries:
        match = _TEMP.match(path.name) or _LEGACY.match(path.name)
        if match and match["kind"] in KINDS and name in (None, match["name"]) and _stale(path, match):
            gone += [path] if _dispose(path, match["kind"], match["name"]) else []
    return gone


def _stale(path: Path, match: re.Match) -> bool:
    try:
        mtime = path.lstat().st_mtime
    except OSError:
        return False
    if "pid" not in match.groupdict():
        return time.time() - mtime > LEGACY_AGE_S
    started = process_start(int(match["pid"]))
    return started is None or started > mtime + 2.0  # clock ticks vs. file times: slack


def _dispose(path: Path, kind: str, name: str) -> bool:
    """Remove (or, for an ``old`` output whose name is free, restore) ``path``
    unless another process holds its lock; True if it did."""
    with _held(path, wait=False) as free:
        if not free:
            return False
        target = path.with_name(name)
        if kind == "old" and not (target.exists() or target.is_symlink()):
            with suppress(OSError):
                path.rename(target)
                return True
        _remove(path)
    return True


def process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), ``-inf`` when it
    is alive but that is unknown (no /proc), None when it is not alive."""
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except (PermissionError, OverflowError):
        pass  # another user's live process (or a pid beyond the kernel's range)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        boot = next(ln for ln in Path("/proc/stat").read_text().splitlines() if ln.startswith("btime"))
        return int(boot.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return float("-inf")


@contextmanager
def _held(path: Path | None, *, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on folder ``path`` (no lock for a file or None):
    yields False if another process holds it and ``wait`` is off."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW) if path else None
    except OSError:  # a file, a link, gone: nothing to lock
        fd = None
    try:
        free = True
        if fd is not None:
            try:  # (no locks on this filesystem, another OSError: the pid rule alone decides)
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                free = False
            except OSError:
                pass
        yield free
    finally:
        if fd is not None:
            os.close(fd)


def replace_refusal(folder: str | Path, ours: Callable[[Path], bool], inputs: Iterable[str | Path] = ()) -> str | None:
    """Why an existing ``folder`` must not be replaced by a new output, or None
    if it may: only an empty folder, or one ``ours`` recognises as written by
    clp-mlx, never a link, a file, the current or home folder or one holding
    them, nor a folder holding any of ``inputs``."""
    folder = Path(os.path.abspath(folder))
    if folder.is_symlink():
        return "it is a symbolic link"
    if not folder.exists():
        return None
    if not folder.is_dir():
        return "it is not a folder"
    real = _real(folder)
    for what, where in (("the current folder", Path.cwd), ("your home folder", Path.home)):
        try:
            here = _real(where())
        except (OSError, RuntimeError):
            continue
        if real == here or real in here.parents:
            return f"it is or holds {what}"
    for source in inputs:
        src = _real(Path(source))
        if src == real or real in src.parents:
            return f"it is or holds the input {source}"
    try:
        if not any(folder.iterdir()) or ours(folder):
            return None
    except OSError as err:
        return f"it cannot be read ({err.strerror})"
    return "it is not a folder clp-mlx wrote (or holds files clp-mlx did not write)"


def _real(path: Path) -> Path:
    """``path`` with every link resolved (as far as it goes: a loop stops it)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return Path(os.path.abspath(path))
