"""The Linux CPU speed path: a fast BLAS preloaded before MLX, the few-row matmul
kernel, and row padding. Nothing outside this stage reads its state directly:
:func:`status` tells what is in use. Nothing imported here loads MLX
(``padrows`` does, so it is not imported here)."""

from .blas import NativeStatus, preload_openblas, status

__all__ = ["NativeStatus", "preload_openblas", "status"]
