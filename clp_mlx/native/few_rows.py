"""Build and load ``few_rows.c``, the few-row matmul kernel (Linux CPU only).

Compiled once per machine with the system C compiler into the cache
(``few_rows/`` under :func:`clp_mlx.paths.cache_root`), keyed by the source,
the compiler and the CPU, and renamed into place only when complete. A library
is loaded only from a folder and a file that belong to this user and that no
one else may write (checked on the open file, so it cannot be swapped in
between); a shared cache is not trusted and the kernel is built privately
instead. Once loaded, a probe product through the process's ``cblas_sgemm``
checks that the kernel really answers (an ``LD_PRELOAD``-ed BLAS comes first).
Nothing here imports MLX: it must run before ``mlx.core`` binds its BLAS
symbols. ``CLP_MLX_FEW_ROWS=0`` turns it off (plain OpenBLAS, as before).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from ..paths import atomic_file, cache_root, umask  # stdlib only: safe before mlx

SOURCE = Path(__file__).with_name("few_rows.c")
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]

_lib: ctypes.CDLL | None = None  # the loaded kernel, for served() and library()


class Untrusted(OSError):
    """A library or folder that someone else could have written."""


def source_key() -> str:
    """A short fingerprint of the kernel's source: times measured with another
    version of it (decode/feed.py's pass costs) are not this one's."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:8]


@functools.cache  # read at import by the kernel's build key and blas.py's core choice
def cpu_info() -> str:
    """The CPU's model and flags: the library is built for the CPU it runs on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(dict.fromkeys(ln for ln in lines if ln.startswith(("model name", "flags"))))


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``avx2``, ``avx512f``, ...); empty where unknown."""
    return {w for ln in cpu_info().splitlines() if ln.startswith("flags") for w in ln.split()}


def _flags(cpu: str) -> list[str]:
    """AVX2 + FMA where the CPU has them (x86-64), and AVX-512VL's 32 vector
    registers of 16 floats for tiles of up to eight rows (four rows, vectors
    of eight floats elsewhere); elsewhere the target's own SIMD."""
    words = set(cpu.split())
    if not {"avx2", "fma"} <= words:
        return FLAGS
    avx512 = {"avx512f", "avx512vl"} <= words
    wide = ["-mavx512f", "-mavx512vl", "-DTILE_ROWS=8", "-DLANES=16"] if avx512 else []
    return FLAGS + ["-mavx2", "-mfma", *wide]


def build(cache: Path, *, again: bool = False) -> Path:
    """The compiled library in ``cache/few_rows``, building it if needed
    (``again``: even if cached); OSError or SubprocessError if it cannot."""
    return _build_into(cache / "few_rows", again=again)


def _build_into(folder: Path, *, again: bool = False) -> Path:
    cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc")]
    if cc[0] is None:
        raise OSError("no C compiler (cc) found")
    cpu = cpu_info()
    flags = _flags(cpu)
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(cc + flags).encode(), cpu.encode()):
        key.update(part)
    lib = folder / f"few_rows-{key.hexdigest()[:16]}.so"
    if lib.exists() and not again:
        return lib
    with atomic_file(lib) as tmp:  # a compile cut short must not look built
        subprocess.run(
            [*cc, *flags, "-o", str(tmp), str(SOURCE)], check=True, capture_output=True, timeout=300
        )
        os.chmod(tmp, 0o755 & ~(umask() | 0o022))  # never writable by others
    return lib


def _private(folder: Path) -> None:
    """Make ``folder`` (mode 0700) or check that it is this user's; take write
    access from group and others if they have it. Untrusted if not ours."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise Untrusted(f"{folder} is not a folder of this user")
    if st.st_mode & 0o022:
        os.chmod(folder, stat.S_IMODE(st.st_mode) & ~0o022)


def _check(st: os.stat_result, path: Path) -> None:
    if st.st_uid != os.geteuid():
        raise Untrusted(f"{path} belongs to another user (uid {st.st_uid})")
    if st.st_mode & 0o022:
        raise Untrusted(f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")


def open_trusted(lib: Path) -> ctypes.CDLL:
    """Load ``lib`` globally if it and its folder are this user's and no one
    else may write them; the checks are on the opened folder and file, which
    is what gets loaded. Untrusted if not; OSError if it does not load."""
    folder = os.open(lib.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        _check(os.fstat(folder), lib.parent)
        fd = os.open(lib.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Untrusted(f"{lib} is not a regular file")
            _check(st, lib)
            return ctypes.CDLL(f"/proc/self/fd/{fd}", mode=ctypes.RTLD_GLOBAL)
        finally:
            os.close(fd)
    finally:
        os.close(folder)


def _load_cached(folder: Path) -> ctypes.CDLL:
    _private(folder)
    try:
        return open_trusted(_build_into(folder))
    except OSError:  # another's, writable by others, or does not load: build it afresh
        return open_trusted(_build_into(folder, again=True))


def _load_private(why: str) -> tuple[ctypes.CDLL, str]:
    """Build into a fresh private folder, load, and delete the file (it stays mapped)."""
    work = Path(tempfile.mkdtemp(prefix="clp-mlx-few-rows-"))
    try:
        return open_trusted(_build_into(work)), f"on (built privately: {why})"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def load() -> tuple[ctypes.CDLL | None, str]:
    """Build and load the kernel globally (call :func:`attach` before any matmul).

    Returns the library, or None if not, and a note saying why it is (not) in
    use, for the benchmark's environment record."""
    global _lib
    if os.environ.get("CLP_MLX_FEW_ROWS", "1") == "0":
        return None, "off (CLP_MLX_FEW_ROWS=0)"
    try:
        try:
            lib, note = _load_cached(cache_root() / "few_rows"), "on"
        except OSError as e:  # a shared or read-only cache: our own copy elsewhere
            why = "is not private" if isinstance(e, Untrusted) else "cannot be used"
            lib, note = _load_private(f"the cache {why}: {e}")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", b"") or b""
        return None, f"off (could not build: {e} {err.decode(errors='replace')[-300:]})".strip()
    lib.few_rows_served.restype = ctypes.c_long
    _lib = lib
    return lib, note


def attach(lib: ctypes.CDLL, openblas: ctypes.CDLL) -> str | None:
    """Hand the kernel OpenBLAS's sgemm for what it does not do, and check that
    the process's ``cblas_sgemm`` is the kernel's: None if so (then OpenBLAS
    goes one-threaded: one thread pool, ours), else why not."""
    lib.few_rows_init(ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p))
    why = _probe(lib)
    if why is None:
        openblas.openblas_set_num_threads(1)
    return why


def _probe(lib: ctypes.CDLL) -> str | None:
    """One 1 x 8 by 8 x 4 product through the symbol MLX will bind to: did the kernel answer it?"""
    sgemm = ctypes.CDLL(None).cblas_sgemm  # the global scope: what libmlx resolves
    floats = ctypes.c_float * 32
    a, b, c = floats(*[1.0] * 8), floats(*[1.0] * 32), floats(*[0.0] * 4)
    sgemm.restype = None
    ptr, num = [ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    sgemm.argtypes = [num] * 6 + [ctypes.c_float, *ptr, *ptr, ctypes.c_float, *ptr]
    before = lib.few_rows_served()
    sgemm(101, 111, 112, 1, 4, 8, 1.0, a, 8, b, 8, 0.0, c, 4)
    if lib.few_rows_served() == before:
        where = _library_of(sgemm)
        preload = " (LD_PRELOAD)" if os.environ.get("LD_PRELOAD") else ""
        return f"off (cblas_sgemm resolves to {where}{preload}, not the kernel)"
    if list(c)[:4] != [8.0] * 4:
        return f"off (the kernel's probe product is wrong: {list(c)[:4]})"
    return None


def _library_of(function) -> str:
    """The file that defines ``function`` (dladdr), or "another library"."""

    class Info(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]

    info = Info()
    try:
        found = ctypes.CDLL(None).dladdr(ctypes.cast(function, ctypes.c_void_p), ctypes.byref(info))
    except (AttributeError, OSError):
        found = 0
    return info.fname.decode(errors="replace") if found and info.fname else "another library"


def served() -> int:
    """How many sgemm calls the kernel answered itself (0 if it is not loaded)."""
    return 0 if _lib is None else _lib.few_rows_served()


def library() -> ctypes.CDLL | None:
    """The loaded kernel (None if not loaded), for calling its sgemm directly."""
    return _lib
