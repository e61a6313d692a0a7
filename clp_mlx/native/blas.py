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

What was loaded is told by :func:`status`, the one way other modules learn it.
"""

import ctypes
import os
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

    @property
    def loaded(self) -> bool:
        """A fast BLAS was preloaded."""
        return self.blas is not None


_status = NativeStatus(blas=None, few_rows=False, note="off")


def status() -> NativeStatus:
    """The BLAS and kernel in use (fixed once :func:`preload_openblas` has run)."""
    return _status


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
        _status = NativeStatus(blas=choice or "openblas", few_rows=answers, note=note)
        return True
    warnings.warn(f"OpenBLAS not found. {_FIX}", RuntimeWarning, stacklevel=2)
    return False
