"""Build and load ``few_rows.c``, the few-row matmul kernel (Linux CPU only).

Compiled once per machine with the system C compiler into the cache
(``few_rows/`` under :func:`clp_mlx.paths.cache_root`), keyed by the source,
the compiler and the CPU, and renamed into place only when complete. Nothing
here imports MLX: it must run before ``mlx.core`` binds its BLAS symbols.
``CLP_MLX_FEW_ROWS=0`` turns it off (plain OpenBLAS, as before).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
from pathlib import Path

from ..paths import atomic_file, cache_root  # stdlib only: safe before mlx

SOURCE = Path(__file__).with_name("few_rows.c")
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]

_lib: ctypes.CDLL | None = None  # the loaded kernel, for served() and library()


def _cpu() -> str:
    """The CPU's model and flags: the library is built for the CPU it runs on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(dict.fromkeys(ln for ln in lines if ln.startswith(("model name", "flags"))))


def _flags(cpu: str) -> list[str]:
    """AVX2 + FMA where the CPU has them (x86-64); elsewhere the target's own SIMD."""
    words = set(cpu.split())
    return FLAGS + (["-mavx2", "-mfma"] if {"avx2", "fma"} <= words else [])


def build(cache: Path, *, again: bool = False) -> Path:
    """The compiled library, building it if needed (``again``: even if cached);
    OSError or SubprocessError if it cannot."""
    cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc")]
    if cc[0] is None:
        raise OSError("no C compiler (cc) found")
    cpu = _cpu()
    flags = _flags(cpu)
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(cc + flags).encode(), cpu.encode()):
        key.update(part)
    lib = cache / "few_rows" / f"few_rows-{key.hexdigest()[:16]}.so"
    if lib.exists() and not again:
        return lib
    with atomic_file(lib) as tmp:  # a compile cut short must not look built
        subprocess.run(
            [*cc, *flags, "-o", str(tmp), str(SOURCE)], check=True, capture_output=True, timeout=300
        )
    return lib


def load() -> tuple[ctypes.CDLL | None, str]:
    """Build and load the kernel globally (call :func:`attach` before any matmul).

    Returns the library, or None if not, and a note saying why it is (not) in
    use, for the benchmark's environment record."""
    global _lib
    if os.environ.get("CLP_MLX_FEW_ROWS", "1") == "0":
        return None, "off (CLP_MLX_FEW_ROWS=0)"
    try:
        cache = cache_root()
        try:
            lib = ctypes.CDLL(str(build(cache)), mode=ctypes.RTLD_GLOBAL)
        except OSError:  # a cached file that does not load (cut short?): build it afresh
            lib = ctypes.CDLL(str(build(cache, again=True)), mode=ctypes.RTLD_GLOBAL)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", b"") or b""
        return None, f"off (could not build: {e} {err.decode(errors='replace')[-300:]})".strip()
    lib.few_rows_served.restype = ctypes.c_long
    _lib = lib
    return lib, "on"


def attach(lib: ctypes.CDLL, openblas: ctypes.CDLL) -> None:
    """Hand the kernel OpenBLAS's sgemm for what it does not do; one thread pool: ours."""
    lib.few_rows_init(ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p))
    openblas.openblas_set_num_threads(1)


def served() -> int:
    """How many sgemm calls the kernel answered itself (0 if it is not loaded)."""
    return 0 if _lib is None else _lib.few_rows_served()


def library() -> ctypes.CDLL | None:
    """The loaded kernel (None if not loaded), for calling its sgemm directly."""
    return _lib
