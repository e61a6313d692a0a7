"""What the benchmark measures besides time: quality of the output, and memory."""

from __future__ import annotations

import resource
import sys
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from .methods import Start


def continuation_nll(model, prompt: list, generated: list, start: Start | None = None) -> float:
    """Sum of -log p(token) over ``generated``, each given prompt + earlier tokens.

    One teacher-forced pass of the backbone in float32: over prompt and
    output, or over the output alone after ``start`` (``prompt`` prefilled).
    """
    if not generated:
        return 0.0
    if start is None:
        ids = mx.array(list(prompt) + list(generated[:-1]), dtype=mx.uint32)
        logits = model(ids[None])[0, len(prompt) - 1 :].astype(mx.float32)
    else:
        start.rewind()
        ids = mx.array(list(prompt[-1:]) + list(generated[:-1]), dtype=mx.uint32)
        logits = model(ids[None], cache=start.cache)[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logp, mx.array(generated, dtype=mx.int32)[:, None], axis=-1)
    nll = float(-mx.sum(picked))
    if start is not None:
        start.rewind()
    return nll


def repetition_ratio(tokens: list) -> float:
    """1 - distinct 3-grams / all 3-grams (the paper's measure)."""
    grams = [tuple(tokens[i : i + 3]) for i in range(len(tokens) - 2)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def common_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def peak_memory_source() -> str:
    if hasattr(mx, "get_peak_memory") and hasattr(mx, "reset_peak_memory"):
        return "mlx.get_peak_memory: MLX memory in use, weights included, reset per run"
    return "resource max RSS: the process's peak so far, cannot be reset per run"


def reset_peak_memory() -> None:
    if hasattr(mx, "reset_peak_memory"):
        mx.reset_peak_memory()


def peak_memory() -> float:
    """Bytes: MLX's peak since the last reset, or the process's max RSS."""
    if hasattr(mx, "get_peak_memory"):
        return float(mx.get_peak_memory())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(rss if sys.platform == "darwin" else rss * 1024)  # macOS: bytes, Linux: KiB
