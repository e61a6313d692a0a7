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
    loose = {"side_layers": 0, "pointer": 0, "pointer_outside": 0}  # a copy head may be added
    if {**bundle.mtp.shape(), **loose} != {**layer.shape(), **loose}:
        width = bundle.mtp.block.args.intermediate_size
        raise ClpError(f"--init-from {folder}: its layer has another shape (--mlp-size {width}?)")
    rank = bundle.mtp.shape().get("pointer", 0)
    if rank and rank != layer.shape().get("pointer", 0):
        raise ClpError(f"--init-from {folder}: its layer has a copy head: give --pointer {rank}")
    layer.update(tree_map(lambda a: a.astype(mx.float32), bundle.mtp.parameters()))
    return bundle.draft_vocab.tolist() if "draft_vocab" in bundle else None
