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
from ..paths import atomic_folder, cache_root
from . import backbone, checks, heads_checks
from .heads import PROBE_MIN_COSINE, Gate, HeadsConfig, MTPBundle, gate_hidden_size
from .mtp_layer import FEED, SHAPE


def init_heads(
    model: nn.Module,
    k: int = 3,
    *,
    design: str = "medusa",
    seed: int = 0,
    gate: bool = True,
    head0: bool = True,
    name: str = "",
    layer: dict | None = None,
) -> MTPBundle:
    """Fresh heads for ``model``, as training starts from them (seeded);
    ``layer``: for the design "mtp", its layer's shape (None: the backbone's
    layers', see :meth:`.mtp_layer.MTPLayer.shape`)."""
    what = "the number of draft tokens (--draft-len)"
    k = checks.whole(checks.whole(k, what, 1), what, most=heads_checks.MAX_K)
    mx.random.seed(checks.seed(seed))
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
    if design == "mtp":
        shape = {key: kind(getattr(model.args, key)) for key, kind in SHAPE.items()}
        config.layer = layer or {**shape, "style": "mtp", "feed": FEED}
    bundle = MTPBundle(config)
    bundle.set_dtype(_float_dtype(model))
    mx.eval(bundle.parameters())
    return bundle


def _float_dtype(model: nn.Module) -> mx.Dtype:
    dtype = model.model.norm.weight.dtype
    return dtype if mx.issubdtype(dtype, mx.floating) else mx.float32


def check_backbone(config: HeadsConfig, model: nn.Module, where: str = "heads", sig=None) -> None:
    """Refuse heads made for another backbone, saying what differs."""
    sig = sig or backbone.signature(model)
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


def drafter_folders() -> list[Path]:
    """Where :func:`find_heads` looks: the user's drafters (``<cache>/drafters/*``,
    by name), then the heads shipped with clp-mlx."""
    found = []
    for root in (cache_root() / "drafters", SHIPPED):
        try:
            found += sorted(p for p in root.iterdir() if (p / "heads.json").is_file())
        except OSError:
            continue  # no such folder, or unreadable: nothing there
    return found


def find_heads(model: nn.Module) -> Path | None:
    """The first heads folder (:func:`drafter_folders`) made for these weights.

    Heads are matched by what the weights are, not by a model's name: the
    shapes and the weight probe (:func:`clp_mlx.model.backbone.signature`),
    so fp32, fp16, bf16, 8-bit and 4-bit copies of the same weights all find
    the heads made on any one of them. A folder that cannot be read or was
    made for other weights is passed over."""
    sig = backbone.signature(model)
    for folder in drafter_folders():
        try:
            check_backbone(read_config(folder), model, sig=sig)
        except (ClpError, OSError):
            continue
        return folder
    return None


def save_heads(
    bundle: MTPBundle, folder: str | Path, *, force: bool = False, extra: dict | None = None
) -> Path:
    """Write ``heads.safetensors`` + ``heads.json`` atomically into ``folder``.

    ``force`` replaces an existing folder only if it holds heads and nothing
    else (:func:`holds_only_heads`): never the working folder or one with
    other files in it."""
    folder = Path(folder)
    if folder.exists() and not force:
        raise ClpError(f"{folder} exists; pass force=True (--force) to replace it")
    try:
        with atomic_folder(folder, ours=holds_only_heads) as tmp:
            weights = dict(tree_flatten(bundle.parameters()))
            mx.save_safetensors(str(tmp / "heads.safetensors"), weights)
            meta = asdict(bundle.config)
            if extra:
                meta["extra"] = extra
            (tmp / "heads.json").write_text(json.dumps(meta, indent=1) + "\n")
    except FileExistsError as e:  # the folder is not one heads may replace
        raise ClpError(f"will not replace {folder}: {e.strerror}; choose another folder") from e
    return folder


HEADS_FILES = ("heads.json", "heads.safetensors", "training.json", "training.png")
SHIPPED = Path(__file__).resolve().parents[1] / "shipped"  # heads packaged with clp-mlx


def holds_only_heads(folder: Path) -> bool:
    """Whether ``folder`` holds clp-mlx heads and nothing else (what
    :func:`save_heads` and training write): a folder --force may replace."""
    try:
        heads_checks.read_meta(Path(folder) / "heads.json")
        present = list(Path(folder).iterdir())
    except (ClpError, OSError):
        return False
    return all(p.name in HEADS_FILES and p.is_file() and not p.is_symlink() for p in present)


def read_config(folder: str | Path) -> HeadsConfig:
    """The checked ``heads.json`` of a heads folder (see :mod:`.heads_checks`)."""
    meta_path = Path(folder) / "heads.json"
    return heads_checks.config_from_meta(heads_checks.read_meta(meta_path), meta_path)


def load_heads(folder: str | Path, model: nn.Module) -> MTPBundle:
    """Load heads saved by :func:`save_heads`, checking they fit ``model``.

    Every field, array, dtype, shape, value and token id is checked before
    MLX computes with it: a heads folder from anywhere gives these heads or
    one ClpError, never a crash or a read out of bounds."""
    folder = Path(folder)
    if not folder.is_dir():
        why = "is not a folder" if folder.exists() else "does not exist"
        raise ClpError(f"heads folder {folder} {why}")
    config = read_config(folder)
    check_backbone(config, model, where=f"heads in {folder}")
    weights = folder / "heads.safetensors"
    arrays = heads_checks.read_weights(weights)
    vocab = backbone.token_count(model)
    heads_checks.check_parts(config, arrays, weights, vocab)
    bundle = MTPBundle(config)
    heads_checks.check_arrays(bundle, arrays, weights, vocab)
    if "draft_vocab" in arrays:
        arrays["draft_vocab"] = arrays["draft_vocab"].astype(mx.int32)
    bundle.load_weights(list(arrays.items()), strict=True)
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
    heads_checks.check_names(bundle, arrays, complete=False)
    bundle.load_weights([(k, mx.array(v)) for k, v in arrays.items()], strict=False)
    bundle.set_dtype(_float_dtype(model))
    mx.eval(bundle.parameters())
    return bundle
