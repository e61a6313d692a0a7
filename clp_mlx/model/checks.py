"""Checks of values that come from outside: options, files, prompts.

Each check returns the value in its plain Python type or raises one
:class:`ClpError` naming the value and what it must be, so a bad value stops
at the boundary instead of reaching MLX, where an out-of-range token id reads
memory past a table (or kills the process) and a wrong type gives a C++
error.
"""

from __future__ import annotations

import math
import numbers

from ..errors import ClpError

SEED_MAX = 2**64 - 1  # mlx.random.key and mx.random.seed take a uint64


def is_whole(value) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def whole(value, what: str, least: int | None = None, most: int | None = None) -> int:
    """``value`` as an int in least..most (either end open when None)."""
    if not is_whole(value):
        raise ClpError(f"{what} must be a whole number, got {value!r}")
    value = int(value)
    if (least is not None and value < least) or (most is not None and value > most):
        if most is None:
            span = f"at least {least}"
        elif least is None:
            span = f"at most {most}"
        else:
            span = f"in {least}..{most}"
        raise ClpError(f"{what} must be {span}, got {value}")
    return value


def real(value, what: str) -> float:
    """``value`` as a finite float (an int or a float, not a bool or a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ClpError(f"{what} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ClpError(f"{what} must be a finite number, got {value}")
    return value


def seed(value, what: str = "the seed") -> int:
    return whole(value, what, 0, SEED_MAX)


def token_ids(values, vocab: int, what: str = "the prompt") -> list[int]:
    """``values`` as a list of token ids, each in 0..vocab-1.

    ``values``: a sequence of ints (Python or NumPy) or a 1-D integer array
    (MLX or NumPy). Text, bytes, bools, floats and nested lists are refused.
    """
    if isinstance(values, (str, bytes, bytearray)):
        raise ClpError(f"{what} must be token ids here, not {type(values).__name__}: encode it first")
    if hasattr(values, "ndim") and hasattr(values, "dtype"):  # an MLX or NumPy array
        if values.ndim != 1 or "int" not in str(values.dtype):
            raise ClpError(
                f"{what} must be a 1-D array of integer token ids, got {values.ndim}-D {values.dtype}"
            )
        values = values.tolist()
    try:
        ids = list(values)
    except TypeError:
        raise ClpError(
            f"{what} must be text or a list of token ids, not {type(values).__name__}"
        ) from None
    for i, t in enumerate(ids):
        if not is_whole(t):
            raise ClpError(f"{what}: item {i} is {t!r}, not a token id (a whole number)")
        if not 0 <= t < vocab:
            raise ClpError(
                f"{what}: token id {t} (item {i}) is outside this model's vocabulary 0..{vocab - 1}"
            )
    return [int(t) for t in ids]
