"""Heads on disk and fresh heads: create, save, load, and the backbone check.

A bundle is saved as ``heads.safetensors`` + ``heads.json``; the JSON records
the backbone it was made for (shape and a probe of its weights), and loading
onto another backbone is refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import ClpError
from ..paths import atomic_folder
from . import backbone
from .heads import FORMAT, PROBE_MIN_COSINE, Gate, HeadsConfig, MTPBundle, gate_hidden_size


def init_heads(
    model: nn.Module,
    k: int = 3,
    *,
    design: str = "medusa",
    seed: int = 0,
    gate: bool = True,
    head0: bool = True,
    name: str = "",
) -> MTPBundle:
    """Fresh heads for ``model``, as training starts from them (seeded)."""
    if k < 1:
        raise ClpError(f"the number of draft tokens must be at least 1, got {k}")
    sig = backbone.signature(model)
    config = HeadsConfig(
        k=k,
        design=design,
        hidden_size=sig["hidden_size"],
        vocab_size=sig["vocab_size"],
        num_layers=sig["num_layers"],
        fingerprint=sig["fingerprint"],
        probe=sig["probe"],
        gate_hidden=gate_hidden_size(sig["hidden_size"], k) if gate else 0,
        head0=head0,
        backbone=name,
    )
    mx.random.seed(seed)
    bundle = MTPBundle(config)
    bundle.set_dtype(_float_dtype(model))
    mx.eval(bundle.parameters())
    return bundle


def _float_dtype(model: nn.Module) -> mx.Dtype:
    dtype = model.model.norm.weight.dtype
    return dtype if mx.issubdtype(dtype, mx.floating) else mx.float32


def check_backbone(config: HeadsConfig, model: nn.Module, where: str = "heads") -> None:
    """Refuse heads made for another backbone, saying what differs."""
    sig = backbone.signature(model)
    for key in ("hidden_size", "vocab_size", "num_layers"):
        if getattr(config, key) != sig[key]:
            raise ClpError(
                f"{where} were made for a backbone with {key}={getattr(config, key)}, "
                f"but this model has {key}={sig[key]}"
            )
    a, b = mx.array(config.probe), mx.array(sig["probe"])
    if a.shape != b.shape:
        raise ClpError(f"{where}: the backbone fingerprint has the wrong length")
    cos = (a @ b / (mx.linalg.norm(a) * mx.linalg.norm(b) + 1e-12)).item()
    if not math.isfinite(cos) or cos < PROBE_MIN_COSINE:
        raise ClpError(
            f"{where} belong to another backbone (fingerprint {config.fingerprint}, "
            f"this model {sig['fingerprint']}; weight probe cosine {cos:.3f})"
        )


def save_heads(
    bundle: MTPBundle, folder: str | Path, *, force: bool = False, extra: dict | None = None
) -> Path:
    """Write ``heads.safetensors`` + ``heads.json`` atomically into ``folder``."""
    folder = Path(folder)
    if folder.exists() and not force:
        raise ClpError(f"{folder} exists; pass force=True (--force) to replace it")
    with atomic_folder(folder) as tmp:
        weights = dict(tree_flatten(bundle.parameters()))
        mx.save_safetensors(str(tmp / "heads.safetensors"), weights)
        meta = asdict(bundle.config)
        if extra:
            meta["extra"] = extra
        (tmp / "heads.json").write_text(json.dumps(meta, indent=1) + "\n")
    return folder


def read_config(folder: str | Path) -> HeadsConfig:
    folder = Path(folder)
    meta_path = folder / "heads.json"
    if not meta_path.is_file():
        raise ClpError(f"{folder} holds no heads (heads.json is missing)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise ClpError(f"{meta_path} is not valid JSON: {e}") from None
    if meta.get("format") != FORMAT:
        raise ClpError(f"{meta_path} is not a clp-mlx heads file")
    known = HeadsConfig.__dataclass_fields__
    config = HeadsConfig(**{k: v for k, v in meta.items() if k in known})
    if not isinstance(config.tree_branches, int) or config.tree_branches < 1:
        raise ClpError(f"{meta_path}: tree_branches must be a whole number >= 1")
    return config


def load_heads(folder: str | Path, model: nn.Module) -> MTPBundle:
    """Load heads saved by :func:`save_heads`, checking they fit ``model``."""
    folder = Path(folder)
    config = read_config(folder)
    check_backbone(config, model, where=f"heads in {folder}")
    bundle = MTPBundle(config)
    try:
        bundle.load_weights(str(folder / "heads.safetensors"), strict=True)
    except (ValueError, FileNotFoundError) as e:
        raise ClpError(f"{folder}: heads.safetensors does not match heads.json ({e})") from None
    bundle.set_dtype(_float_dtype(model))
    mx.eval(bundle.parameters())
    return bundle


def bundle_from_arrays(
    arrays: dict, *, model: nn.Module, design: str = "medusa", name: str = ""
) -> MTPBundle:
    """Build a bundle from weights in our key names (converters use this).

    k, the gate and head 0 are inferred from the keys; a missing CLP stays
    as initialised. Shapes are checked by ``load_weights``.
    """
    ids = {int(key.split(".")[1]) for key in arrays if key.startswith("heads.")}
    if not ids or ids != set(range(len(ids))):
        raise ClpError(f"head indices must run 0..k-1, got {sorted(ids)}")
    gate_w = arrays.get("gate.fc1.weight")
    bundle = init_heads(
        model, len(ids), design=design, gate=False, head0="head0.linear.weight" in arrays, name=name
    )
    if gate_w is not None:
        bundle.config.gate_hidden = int(gate_w.shape[0])
        bundle.gate = Gate(bundle.config.hidden_size, bundle.k, bundle.config.gate_hidden)
    expected = dict(tree_flatten(bundle.parameters()))
    unknown = sorted(set(arrays) - set(expected))
    if unknown:
        raise ClpError(f"unknown head weights: {', '.join(unknown)}")
    for key, value in arrays.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ClpError(
                f"{key} has shape {tuple(value.shape)}, this backbone needs "
                f"{tuple(expected[key].shape)}"
            )
    bundle.load_weights([(k, mx.array(v)) for k, v in arrays.items()], strict=False)
    bundle.set_dtype(_float_dtype(model))
    mx.eval(bundle.parameters())
    return bundle
