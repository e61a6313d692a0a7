"""Where ``train_mtp --init-from`` starts: a drafter's MTP layer, checked
against the layer these flags make, and its draft vocabulary."""

from __future__ import annotations

from pathlib import Path

from ..errors import ClpError
from .mtp_trainer import MTPTrainConfig


def kept_vocab(ids, cfg: MTPTrainConfig):
    """The init drafter's draft vocabulary, checked against --draft-vocab."""
    import numpy as np

    if ids is None:
        raise ClpError(f"--keep-vocab: the drafter in {cfg.init_from} has no draft vocabulary")
    if len(ids) != cfg.draft_vocab:
        raise ClpError(f"--keep-vocab: the drafter in {cfg.init_from} drafts from {len(ids)} "
                       f"tokens: give --draft-vocab {len(ids)}")  # fmt: skip
    return np.asarray(ids)


def start_from(layer, model, folder: Path):
    """``layer`` takes the MTP layer of the drafter in ``folder``; its draft
    vocabulary (token ids, None for the whole) is returned. The layer's
    weights do not depend on it (drafts are read through the backbone's own
    output rows), so by default this run's data chooses its own, and its ids
    fill what the data leaves (--keep-vocab: it is kept whole)."""
    import mlx.core as mx
    from mlx.utils import tree_map

    from ..model.heads_files import load_heads

    bundle = load_heads(folder, model)  # checked against this backbone
    if bundle.config.design != "mtp" or bundle.mtp.style != "mtp":
        raise ClpError(f"--init-from {folder}: not an MTP-layer drafter (train_mtp writes those)")
    if bundle.mtp.side_layers and bundle.mtp.side_layers != layer.side_layers:
        raise ClpError(f"--init-from {folder}: its layer reads the states after layers "
                       f"{list(bundle.mtp.side_layers)}: give --side and data keeping those")  # fmt: skip
    # a copy head may be added, and the MLP widened
    loose = {"side_layers": 0, "pointer": 0, "pointer_outside": 0, "intermediate_size": 0}
    width = bundle.mtp.block.args.intermediate_size
    if {**bundle.mtp.shape(), **loose} != {**layer.shape(), **loose} or (
        width > layer.block.args.intermediate_size
    ):
        raise ClpError(f"--init-from {folder}: its layer has another shape (--mlp-size {width}?)")
    rank = bundle.mtp.shape().get("pointer", 0)
    if rank and rank != layer.shape().get("pointer", 0):
        raise ClpError(f"--init-from {folder}: its layer has a copy head: give --pointer {rank}")
    params = tree_map(lambda a: a.astype(mx.float32), bundle.mtp.parameters())
    layer.update(widened(params, layer))
    return bundle.draft_vocab.tolist() if "draft_vocab" in bundle else None


def widened(params: dict, layer) -> dict:
    """``params`` of a layer whose MLP is narrower than ``layer``'s, made
    ``layer``'s width without changing what the layer computes: the new units'
    gate and up rows are ``layer``'s own (random) ones, their down-projection
    columns zero, so they add nothing until training moves them (the widening
    of Net2Net, Chen et al. 2016, arXiv 1511.05641, with zero outputs). The
    same ``params`` where the widths are equal."""
    import mlx.core as mx

    mlp, fresh = params["block"]["mlp"], layer.block.mlp
    have, want = mlp["down_proj"]["weight"].shape[1], fresh.down_proj.weight.shape[1]
    if have == want:
        return params
    down = mlp["down_proj"]["weight"]
    mlp["down_proj"]["weight"] = mx.concatenate(
        [down, mx.zeros((down.shape[0], want - have), dtype=down.dtype)], axis=1
    )
    for name in ("gate_proj", "up_proj"):
        rows = getattr(fresh, name).weight[have:].astype(mlp[name]["weight"].dtype)
        mlp[name]["weight"] = mx.concatenate([mlp[name]["weight"], rows], axis=0)
    return params
