"""Steps the GGUF and the Hugging Face converters share.

Both check their options before reading a byte of the source, refuse to
replace an output folder without ``force``, build an empty mlx-lm Qwen2 model
to check the weights against, and quantize it as ``mlx_lm.convert -q`` does.
Each converter keeps its own choices (GGUF offers fewer bit widths) and its
own wording of them, since the ``convert`` command's errors quote that wording.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from clp_mlx.errors import ClpError
from clp_mlx.model.checks import qwen2_config
from clp_mlx.paths import replace_refusal

MARKER = "made_from.json"  # in every folder a converter writes: what --force may replace


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


def check_output(
    out_dir: str | os.PathLike[str],
    force: bool,
    inputs: Iterable[Path],
    ours: Callable[[Path], bool] | None = None,
) -> Path:
    """The output folder as an absolute path (so "." or "x/" still has a name).
    An existing one is replaced only when the caller says so, and only if it
    is empty or clp-mlx wrote it (``ours``, by default :func:`made_here`), never
    one holding ``inputs``, the current folder or a link
    (:func:`clp_mlx.paths.replace_refusal`)."""
    out = Path(os.path.abspath(out_dir))
    if not (out.exists() or out.is_symlink()):
        return out
    if not force:
        raise ClpError(f"output folder {out} already exists (use --force to replace it)")
    why = replace_refusal(out, ours or made_here, inputs)
    if why is not None:
        raise ClpError(f"refusing to replace {out} (--force): {why}")
    return out


def write_marker(folder: Path, converter: str, source: Path, **options: Any) -> None:
    """Write :data:`MARKER` last: what made the folder and the files it holds."""
    files = sorted(p.name for p in folder.iterdir())
    made = {"made_by": "clp-mlx", "converter": converter, "source": source.name, **options}
    text = json.dumps({**made, "files": files}, indent=1) + "\n"
    (folder / MARKER).write_text(text, encoding="utf-8")


def made_here(folder: Path) -> bool:
    """Whether a converter of clp-mlx wrote ``folder``: its marker says so and
    it holds only files the marker lists."""
    try:
        made = json.loads((folder / MARKER).read_text(encoding="utf-8"))
        present = {p.name: p.is_dir() and not p.is_symlink() for p in folder.iterdir()}
    except (OSError, ValueError):
        return False
    if not isinstance(made, dict) or made.get("made_by") != "clp-mlx":
        return False
    files = made.get("files")
    if not isinstance(files, list):
        return False
    return all(name in files or name == MARKER for name in present) and not any(present.values())


def read_json(path: Path, what: str = "file") -> Any:
    """``path`` parsed as JSON; a ClpError if it cannot be read or parsed."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ClpError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ClpError(f"{path} is not a valid JSON {what}: {str(e)[:200]}") from None


@contextmanager
def writing(out: Path) -> Iterator[None]:
    """Turn an OSError while converting (unwritable folder, full disk) into a
    ClpError naming the path."""
    try:
        yield
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(out) else ""
        raise ClpError(f"cannot write {out}: {e.strerror or e}{where}") from None


def empty_qwen2(config: dict[str, Any], where: str = "config") -> Any:
    """An mlx-lm Qwen2 model whose parameters are still unevaluated (free);
    a config it cannot build is a ClpError (the checks are the ones an MLX
    folder's config gets too: :func:`clp_mlx.model.checks.qwen2_config`)."""
    from mlx_lm.models import qwen2  # mlx_lm pulls in transformers: import only when converting

    qwen2_config(config, where)
    try:
        return qwen2.Model(qwen2.ModelArgs.from_dict(config))
    except (TypeError, KeyError, ValueError, AttributeError, AssertionError, ArithmeticError) as e:
        raise ClpError(f"{where} does not describe a Qwen2 model ({e})") from None


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
