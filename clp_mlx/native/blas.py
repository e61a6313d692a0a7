"""Load a fast BLAS into the process before MLX is imported (Linux only).

MLX's Linux CPU wheel bundles a reference BLAS that multiplies fp32 matrices at
about 5 GFLOP/s. OpenBLAS, loaded with RTLD_GLOBAL before ``mlx.core``
resolves its BLAS symbols, reaches 100-180 GFLOP/s on the same machine: the
difference between a usable and an unusable CPU backend. On macOS MLX uses
Accelerate and Metal, so nothing is done there.

Decoding multiplies a few rows at a time, where OpenBLAS is slow; the kernel
of ``few_rows.c`` (built on first use, see :mod:`clp_mlx.native.few_rows`)
takes those and hands the rest to OpenBLAS.

``CLP_MLX_BLAS=<library>`` loads another CBLAS instead, without the kernel
(e.g. BLIS's ``libblis.so.4``; see the README).

OpenBLAS as distributions build it (``DYNAMIC_ARCH``) chooses its kernels by
the CPU's model number when it loads. A release older than the CPU does not
know the number and falls back to its SSE3 kernels ("Prescott"): Debian 12's
0.3.21 on a 2023 Xeon multiplies fp32 at 35-50 GFLOP/s instead of ~200, which
makes prompts and batched data generation 3-4x slower, training 2x. So unless
``OPENBLAS_CORETYPE`` is set already, it is set from the CPU's flags before the
library loads (:func:`core_for`): the kernels newer releases pick on such CPUs.

What was loaded is told by :func:`status`, the one way other modules learn it.
"""

import ctypes
import os
import platform
import sys
import warnings
from dataclasses import dataclass

from . import few_rows as _few_rows

_FIX = (
    "Decoding on the CPU will be about 30x slower than it should. Install "
    "OpenBLAS (Debian/Ubuntu: apt-get install libopenblas0-pthread) or set "
    "CLP_MLX_NO_OPENBLAS=1 to silence this warning."
)


@dataclass(frozen=True)
class NativeStatus:
    """What multiplies fp32 matrices on the CPU in this process."""

    blas: str | None  # "openblas", the CLP_MLX_BLAS library, or None: MLX's bundled BLAS
    few_rows: bool  # the few-row kernel answers MLX's sgemm calls
    note: str  # why the kernel is (not) in use, for the benchmark's environment record
    core: str | None = None  # the kernels OpenBLAS chose (openblas_get_corename)

    @property
    def loaded(self) -> bool:
        """A fast BLAS was preloaded."""
        return self.blas is not None


_status = NativeStatus(blas=None, few_rows=False, note="off")


def status() -> NativeStatus:
    """The BLAS and kernel in use (fixed once :func:`preload_openblas` has run)."""
    return _status


def core_for(flags: set[str]) -> str | None:
    """The OpenBLAS core type for an x86-64 CPU with these ``/proc/cpuinfo``
    flags: the AVX-512 kernels where it has AVX-512 (F, CD, BW, DQ, VL), the
    AVX2 ones where it has AVX2 and FMA; None (let OpenBLAS choose) otherwise."""
    if {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def _choose_core() -> None:
    """Set ``OPENBLAS_CORETYPE`` from the CPU's flags, unless the user set it."""
    if "OPENBLAS_CORETYPE" in os.environ or platform.machine() not in ("x86_64", "AMD64"):
        return
    core = core_for(_few_rows.cpu_flags())
    if core:
        os.environ["OPENBLAS_CORETYPE"] = core  # read once, when the library loads


def _core_name(blas: ctypes.CDLL) -> str | None:
    try:
        get = blas.openblas_get_corename
    except AttributeError:  # not OpenBLAS (CLP_MLX_BLAS)
        return None
    get.restype = ctypes.c_char_p
    return get().decode(errors="replace")


def preload_openblas() -> bool:
    """Load ``libopenblas.so.0`` globally; warn once with the fix if missing."""
    global _status
    if _status.loaded or sys.platform != "linux" or os.environ.get("CLP_MLX_NO_OPENBLAS"):
        return _status.loaded
    if "mlx.core" in sys.modules:  # its BLAS symbols are bound: too late
        warnings.warn(
            "mlx.core was imported before clp_mlx, so OpenBLAS could not be loaded. "
            f"Import clp_mlx first. {_FIX}",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    choice = os.environ.get("CLP_MLX_BLAS")
    if not choice:
        _choose_core()
    for name in [choice] if choice else ["libopenblas.so.0", "libopenblas.so"]:
        try:
            blas = ctypes.CDLL(name)  # found? (local: the kernel must come first globally)
        except OSError:
            continue
        kernel, note = (None, "off") if choice else _few_rows.load()
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        answers = kernel is not None
        if answers:  # loaded, but is it what cblas_sgemm means in this process?
            why_not = _few_rows.attach(kernel, blas)
            answers, note = why_not is None, note if why_not is None else why_not
        _status = NativeStatus(choice or "openblas", answers, note, _core_name(blas))
        return True
    warnings.warn(f"OpenBLAS not found. {_FIX}", RuntimeWarning, stacklevel=2)
    return False
