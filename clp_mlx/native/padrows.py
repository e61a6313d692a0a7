"""Cheaper wide passes on OpenBLAS: multiply 3-15 rows as 16.

A verify step feeds a few tokens at once, so every matmul of its pass has
3-5 rows. OpenBLAS (0.3.21, fp32, 2 threads, measured on a 1536 x 8960
weight) takes 9.9 ms for 4 rows and 8.0 ms for 16, against 5.9 ms for one:
its small-row path is slower than its blocked kernel. Padding the rows with
zeros to 16 and dropping them after made a 4-token pass of the 0.5B 11%
cheaper and of the 1.5B 18%. One-row (plain decoding) and two-row matmuls
are left alone; so is everything off that path (GPUs, other BLAS, fp16,
quantized layers). ``CLP_MLX_PAD_ROWS=0`` turns it off.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

from .blas import status

ROWS = 16  # the padded height
FROM = 3  # pad matmuls with at least this many rows (and fewer than ROWS)


def _padded(fn, x: mx.array) -> mx.array:
    m = x.shape[-2] if x.ndim >= 2 else 0
    if not FROM <= m < ROWS:
        return fn(x)
    zeros = mx.zeros((*x.shape[:-2], ROWS - m, x.shape[-1]), dtype=x.dtype)
    return fn(mx.concatenate([x, zeros], axis=-2))[..., :m, :]


class PaddedLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        return _padded(super().__call__, x)


class PaddedEmbedding(nn.Embedding):
    """A tied embedding whose output projection pads its rows."""

    def as_linear(self, x: mx.array) -> mx.array:
        return _padded(super().as_linear, x)


def wanted(model: nn.Module) -> bool:
    """On where it was measured to pay: OpenBLAS, the CPU, fp32 weights."""
    if os.environ.get("CLP_MLX_PAD_ROWS", "1") == "0" or os.environ.get("CLP_MLX_BLAS"):
        return False
    fp32 = model.model.norm.weight.dtype == mx.float32
    native = status()
    # The few-row kernel makes 4 rows cheaper than 16: padding would cost.
    return native.loaded and not native.few_rows and mx.default_device() == mx.cpu and fp32


def pad_rows(model: nn.Module, force: bool = False) -> bool:
    """Make the model's float linear layers pad 3-15 rows to 16 (in place),
    where :func:`wanted` (or ``force``) says so; True if it did."""
    if not (force or wanted(model)):
        return False
    swap = {nn.Linear: PaddedLinear, nn.Embedding: PaddedEmbedding}
    for _, module in model.named_modules():
        if type(module) in swap:  # exact type: quantized layers stay as they are
            module.__class__ = swap[type(module)]
    return True


def is_padded(model: nn.Module) -> bool:
    return any(isinstance(m, PaddedLinear) for _, m in model.named_modules())
