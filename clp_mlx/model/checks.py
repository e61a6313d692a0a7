"""Checks of values that come from outside: options, files, prompts, model configs.

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
        raise ClpError(
            f"{what} must be token ids here, not {type(values).__name__}: encode it first"
        )
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


# Qwen2's config.json, whether read from a folder or built from GGUF metadata.
QWEN2_SIZES = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "vocab_size",
)  # fmt: skip
MAX_LAYERS = 4096  # Qwen2's largest has 80; a bigger count is a broken config, not a model
SHAPE_MAX = 2**31 - 1  # MLX's shapes are 32-bit
_FACTOR_NEEDED = ("linear", "dynamic", "yarn")  # rope_scaling types mlx-lm reads a factor for


def json_kind(value) -> str:
    """What JSON calls the type of ``value``, for messages."""
    kinds = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "true/false",
        type(None): "null",
    }
    return kinds.get(type(value), "a number")


def qwen2_config(config, where: str) -> dict:
    """``config`` as it is, unless it is not a Qwen2 config mlx-lm can build:
    then one ClpError line that starts with ``where`` and names the field.

    Fields mlx-lm does not use (``architectures``, ``sliding_window``,
    ``max_window_layers``, ``torch_dtype``, token ids...) are not looked at.
    """
    if not isinstance(config, dict):
        raise ClpError(f"{where} must hold a JSON object, not {json_kind(config)}")
    kind = config.get("model_type")
    if kind != "qwen2":
        what = "has no model_type" if kind is None else f"model_type {kind!r} is not qwen2"
        raise ClpError(f"{where} {what}: clp-mlx runs Qwen2 models")
    for key in (*QWEN2_SIZES, "max_position_embeddings"):
        if key not in config:
            if key == "max_position_embeddings":  # optional: mlx-lm has a default
                continue
            raise ClpError(f"{where}: {key} is missing")
        whole(
            config[key],
            f"{where}: {key}",
            1,
            MAX_LAYERS if key == "num_hidden_layers" else SHAPE_MAX,
        )
    for key in ("rms_norm_eps", "rope_theta"):
        if key in config and not real(config[key], f"{where}: {key}") > 0:
            raise ClpError(f"{where}: {key} must be above 0, got {config[key]}")
    for key in ("tie_word_embeddings", "rope_traditional"):
        if key in config and not isinstance(config[key], bool):
            raise ClpError(f"{where}: {key} must be true or false, not {json_kind(config[key])}")
    hidden, heads, kv = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    if hidden % heads or heads % kv or (hidden // heads) % 2:
        raise ClpError(
            f"{where}: hidden_size {hidden}, {heads} attention heads and {kv} key-value heads "
            "do not fit (an even head size, attention heads a multiple of key-value heads)"
        )
    _rope_scaling(config.get("rope_scaling"), f"{where}: rope_scaling")
    return config


def _rope_scaling(scaling, what: str) -> None:
    """null, or an object as in Qwen's configs: {"type": "yarn", "factor": 4.0, ...}."""
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ClpError(f"{what} must be an object or null, not {json_kind(scaling)}")
    kind = scaling.get("type") or scaling.get("rope_type", "default")
    if not isinstance(kind, str):
        raise ClpError(f'{what}: its type must be a name such as "yarn", not {json_kind(kind)}')
    if kind in _FACTOR_NEEDED and "factor" not in scaling:
        raise ClpError(f"{what}: type {kind!r} needs a factor")
    if "factor" in scaling and not real(scaling["factor"], f"{what}: factor") > 0:
        raise ClpError(f"{what}: factor must be above 0, got {scaling['factor']}")
    if "original_max_position_embeddings" in scaling:
        whole(
            scaling["original_max_position_embeddings"],
            f"{what}: original_max_position_embeddings",
            1,
        )
