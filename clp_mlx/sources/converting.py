"""Steps the GGUF and the Hugging Face converters share.

Both check their options before reading a byte of the source, refuse to
replace an output folder without ``force``, build an empty mlx-lm Qwen2 model
to check the weights against, and quantize it as ``mlx_lm.convert -q`` does.
Each converter keeps its own choices (GGUF offers fewer bit widths) and its
own wording of them, since the ``convert`` command's errors quote that wording.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from clp_mlx.errors import ClpError


@dataclass(frozen=True)
class Choices:
    """The dtypes and quantization settings one converter accepts."""

    dtypes: Mapping[str, mx.Dtype]
    q_bits: tuple[int, ...]
    q_group_sizes: tuple[int, ...]
    spell: Callable[[tuple[int, ...]], str]  # how an error message lists q_bits or q_group_sizes

    def check(self, dtype: str, q_bits: int | None, q_group_size: int) -> None:
        """Raise ClpError for a dtype or quantization setting outside the choices."""
        if dtype not in self.dtypes:
            raise ClpError(f"unknown dtype {dtype!r}; choose from {', '.join(self.dtypes)}")
        if q_bits is not None and q_bits not in self.q_bits:
            raise ClpError(f"unsupported quantization bits {q_bits}; choose {self.spell(self.q_bits)}")
        if q_bits is not None and q_group_size not in self.q_group_sizes:
            raise ClpError(
                f"unsupported quantization group size {q_group_size}; "
                f"choose {self.spell(self.q_group_sizes)}"
            )


def check_output(out: Path, force: bool) -> None:
    """An existing output folder is replaced only when the caller says so."""
    if out.exists() and not force:
        raise ClpError(f"output folder {out} already exists (use --force to replace it)")


def empty_qwen2(config: dict[str, Any]) -> Any:
    """An mlx-lm Qwen2 model whose parameters are still unevaluated (free)."""
    from mlx_lm.models import qwen2  # mlx_lm pulls in transformers: import only when converting

    return qwen2.Model(qwen2.ModelArgs.from_dict(config))


def load_and_quantize(
    model: Any,
    weights: dict[str, mx.array],
    config: dict[str, Any],
    q_bits: int | None,
    q_group_size: int,
) -> tuple[Any, dict[str, Any]]:
    """Move ``weights`` into ``model`` and quantize it when ``q_bits`` is set.

    ``weights`` is emptied so that the model holds the only reference to each
    array: quantizing then frees every float weight as soon as it is replaced.
    Returns the model and its config (quantizing adds a ``quantization`` entry).
    """
    model.load_weights(list(weights.items()), strict=True)
    weights.clear()
    if q_bits is not None:
        from mlx_lm.utils import quantize_model

        model, config = quantize_model(model, config, q_group_size, q_bits)
    return model, config
