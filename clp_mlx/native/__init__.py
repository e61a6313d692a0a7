"""The Linux CPU speed path: a fast BLAS preloaded before MLX, the few-row matmul
kernel, and row padding. Nothing outside this stage reads its state directly."""
