"""Checks of a heads folder, before any of it reaches MLX.

A heads folder may come from anywhere (a download, a converter, another
version). ``heads.json`` is checked field by field, then ``heads.safetensors``
against it: the same parts and sizes, the dtypes and shapes the bundle
needs, finite weights, and draft-vocabulary ids inside the backbone's
vocabulary (an id past it would index memory beyond the output projection).
Every refusal is one :class:`ClpError` saying what is wrong and what to do.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..errors import ClpError
from .checks import real, whole
from .heads import DESIGNS, FORMAT, HeadsConfig, MTPBundle
from .mtp_layer import FEED, SHAPE, STYLES

MAX_K = 64  # drafts per step; the paper's heads draft 3 to 5
MAX_LOOKUP = 32  # longest n-gram context drafts match
CONTEXT_NGRAM = 3  # the MTP layer's drafters: context copies of the last 1..3 tokens first
META_MAX_BYTES = 1 << 20  # a heads.json is a few kB (the probe is 256 numbers)
FLOATS = (mx.float16, mx.bfloat16, mx.float32)
FIX = "make the heads again (python -m clp_mlx.train) or fetch them again"


def read_meta(path: Path) -> dict:
    """``heads.json`` as a dict: UTF-8 JSON, an object, in our format."""
    if not path.is_file():
        raise ClpError(f"{path.parent} holds no heads (heads.json is missing)")
    try:
        if path.stat().st_size > META_MAX_BYTES:
            raise ClpError(f"{path} is too large to be a heads.json ({path.stat().st_size} bytes)")
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ClpError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise ClpError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ClpError(f"{path} is not a clp-mlx heads file")
    return meta


def _flag(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise ClpError(f"{what} must be true or false, got {value!r}")
    return value


def _text(value, what: str) -> str:
    if not isinstance(value, str):
        raise ClpError(f"{what} must be a string, got {value!r}")
    return value


def _probe(value, what: str) -> list:
    if not isinstance(value, list) or not value:
        raise ClpError(f"{what} must be a non-empty list of numbers")
    return [real(v, f"{what}[{i}]") for i, v in enumerate(value)]


def _design(value, what: str) -> str:
    if value not in DESIGNS:
        raise ClpError(f"{what} must be one of {', '.join(DESIGNS)}, got {value!r}")
    return value


def _layer(value, what: str) -> dict:
    """An MTP layer's shape: the fields :data:`.mtp_layer.SHAPE` names, positive."""
    if not isinstance(value, dict):
        raise ClpError(f"{what} must be an object")
    if not value:
        return {}
    out = {}
    for key, kind in SHAPE.items():
        if key not in value:
            raise ClpError(f"{what} lacks {key}")
        v = value[key]
        out[key] = whole(v, f"{what}.{key}", 1) if kind is int else real(v, f"{what}.{key}")
        if out[key] <= 0:
            raise ClpError(f"{what}.{key} must be positive, got {v!r}")
    out["style"] = value.get("style", "mtp")
    if out["style"] not in STYLES:
        raise ClpError(f"{what}.style must be one of {', '.join(STYLES)}, got {out['style']!r}")
    if out["style"] == "mtp":
        if value.get("feed") != FEED:
            raise ClpError(f"{what}: an MTP layer trained before its later depths read the final "
                           "norm of its output (no feed: norm); retrain it with train_mtp")  # fmt: skip
        out["feed"] = FEED
    side = value.get("side_layers", [])
    if not isinstance(side, list) or len(set(map(repr, side))) != len(side):
        raise ClpError(f"{what}.side_layers must be a list of distinct layer counts")
    if side:
        out["side_layers"] = [whole(n, f"{what}.side_layers", 1) for n in side]
    if "pointer" in value:  # a copy head's rank (model/pointer.py)
        out["pointer"] = whole(value["pointer"], f"{what}.pointer", 1, most=4096)
    if "pointer_outside" in value:  # it also copies tokens outside the draft vocabulary
        if value["pointer_outside"] is not True or "pointer" not in value:
            raise ClpError(f"{what}.pointer_outside must be true, and only with a pointer")
        out["pointer_outside"] = True
    if out["num_attention_heads"] % out["num_key_value_heads"]:
        raise ClpError(f"{what}: num_attention_heads must be a multiple of num_key_value_heads")
    return out


def _temperatures(value, what: str) -> list:
    if not isinstance(value, list) or len(value) > MAX_K:
        raise ClpError(f"{what} must be a list of at most {MAX_K} numbers")
    out = [real(v, f"{what}[{i}]") for i, v in enumerate(value)]
    for i, t in enumerate(out):
        if not 0.01 <= t <= 100:
            raise ClpError(f"{what}[{i}] must be in [0.01, 100], got {t}")
    return out


FIELDS = {  # heads.json field -> its check
    "k": lambda v, w: whole(v, w, 1, MAX_K),
    "design": _design,
    "hidden_size": lambda v, w: whole(v, w, 1),
    "vocab_size": lambda v, w: whole(v, w, 1),
    "num_layers": lambda v, w: whole(v, w, 1),
    "fingerprint": _text,
    "probe": _probe,
    "gate_hidden": lambda v, w: whole(v, w, 0),
    "head0": _flag,
    "draft_vocab": lambda v, w: whole(v, w, 0),
    "lookup": lambda v, w: whole(v, w, 0, MAX_LOOKUP),
    "clp_norm": _flag,
    "tree_branches": lambda v, w: whole(v, w, 1),
    "backbone": _text,
    "format": _text,
    "version": lambda v, w: whole(v, w, 1),
    "layer": _layer,
    "temperatures": _temperatures,
}


def config_from_meta(meta: dict, where: Path) -> HeadsConfig:
    """A :class:`HeadsConfig` from ``heads.json``'s fields, each checked."""
    if "k" not in meta:
        raise ClpError(f"{where}: the field k (drafts per step) is missing; {FIX}")
    values = {n: check(meta[n], f"{where}: {n}") for n, check in FIELDS.items() if n in meta}
    config = HeadsConfig(**values)
    if (config.design == "mtp") != bool(config.layer):
        raise ClpError(f"{where}: the design mtp, and only it, needs the field layer; {FIX}")
    if config.temperatures and len(config.temperatures) != config.k:
        raise ClpError(f"{where}: temperatures must give one per depth (k = {config.k}); {FIX}")
    if config.design == "mtp" and config.hidden_size % config.layer["num_attention_heads"]:
        raise ClpError(f"{where}: hidden_size is not a multiple of layer.num_attention_heads")
    return config


def read_weights(path: Path) -> dict:
    """The arrays of ``heads.safetensors``, lazily: MLX checks the header
    (offsets inside the file, known dtypes) and reads no data yet."""
    if not path.is_file():
        raise ClpError(f"{path} is missing; {FIX}")
    try:
        return dict(mx.load(str(path), format="safetensors"))
    except OSError as e:
        raise ClpError(f"cannot read {path}: {e.strerror or e}") from None
    except (RuntimeError, ValueError) as e:
        raise ClpError(f"{path} is not a readable safetensors file ({e}); {FIX}") from None


def check_parts(config: HeadsConfig, arrays: dict, where: Path, vocab: int) -> None:
    """The parts and sizes heads.json names are those the file holds.

    Checked before a bundle is built, so that no size in heads.json decides
    an allocation that the file does not back."""
    heads = {name.split(".")[1] for name in arrays if name.startswith("heads.")}
    if heads != ({str(i) for i in range(config.k)} if config.design != "mtp" else set()):
        raise ClpError(
            f"{where}: heads.json says k={config.k}; the weights hold heads {sorted(heads)}"
        )
    sized = {  # field: (its value, the array that holds it, the array's axis)
        "gate_hidden": (config.gate_hidden, "gate.fc1.weight", 0),
        "lookup": (config.lookup and config.lookup + 1, "clp_context", 0),
        "draft_vocab": (config.draft_vocab, "draft_vocab", 0),
        "head0": (int(config.head0), "head0.linear.weight", None),
    }
    for field, (size, name, axis) in sized.items():
        held = arrays.get(name)
        if bool(size) != (held is not None) or (
            held is not None
            and axis is not None
            and (held.ndim <= axis or held.shape[axis] != size)
        ):
            raise ClpError(
                f"{where}: heads.json's {field} does not match the weights' {name}; {FIX}"
            )
    if config.draft_vocab > vocab:
        raise ClpError(
            f"{where}: draft_vocab {config.draft_vocab} is larger than the vocabulary {vocab}"
        )


def check_names(bundle: MTPBundle, arrays: dict, before="", after="", complete=True) -> None:
    """Every array is one the bundle has, with its shape (``complete``: and
    every one the bundle has is there). Errors read ``before`` + why + ``after``."""
    expected = dict(tree_flatten(bundle.parameters()))
    unknown = sorted(set(arrays) - set(expected))
    missing = sorted(set(expected) - set(arrays)) if complete else []
    if unknown:
        raise ClpError(f"{before}unknown head weights: {', '.join(unknown)}{after}")
    if missing:
        raise ClpError(f"{before}missing head weights: {', '.join(missing)}{after}")
    for name, a in arrays.items():
        if tuple(a.shape) != tuple(expected[name].shape):
            need = tuple(expected[name].shape)
            raise ClpError(
                f"{before}{name} has shape {tuple(a.shape)}, this backbone needs {need}{after}"
            )


def check_arrays(bundle: MTPBundle, arrays: dict, where: Path, vocab: int) -> None:
    """Every array has the name, shape and dtype the bundle needs, finite
    values, and draft-vocabulary ids in 0..vocab-1. Reads the data."""
    check_names(bundle, arrays, f"{where}: ", f"; {FIX}")
    for name, a in arrays.items():
        if name == "draft_vocab":
            right, need = mx.issubdtype(a.dtype, mx.integer), "integer"
        else:
            right, need = a.dtype in FLOATS, "float16, bfloat16 or float32"
        if not right:
            dtype = str(a.dtype).removeprefix("mlx.core.")
            raise ClpError(f"{where}: {name} has dtype {dtype}, it must be {need}; {FIX}")
    _check_values(arrays, where, vocab)


def _check_values(arrays: dict, where: Path, vocab: int) -> None:
    try:
        mx.eval(list(arrays.values()))
    except (RuntimeError, ValueError, OSError) as e:
        raise ClpError(f"{where}: cannot read the weights ({e}); {FIX}") from None
    for name, a in arrays.items():
        if name == "draft_vocab":
            if a.size and not (mx.min(a).item() >= 0 and mx.max(a).item() < vocab):
                raise ClpError(
                    f"{where}: draft_vocab holds token ids outside this model's vocabulary "
                    f"0..{vocab - 1}; {FIX}"
                )
        elif not mx.all(mx.isfinite(a)).item():
            raise ClpError(f"{where}: {name} holds values that are not finite (NaN or inf); {FIX}")
