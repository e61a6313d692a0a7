"""The paper's gate and head 0 baselines on a trained MTP layer: :func:`fit_baselines`.

As on the heads (train/fit.py, ``train_decisions``): the gate learns from the
layer's own chain drafts on held-out rows whether each depth's draft is
right, and head 0 (the prior-MTP baseline's competing t+1 head, starting as
the identity, so as the backbone) learns the row's t+1 from ``h`` over the
draft vocabulary, as the heads' trainer teaches it. The layer, its
temperatures and its CLP (its own chances) stay as they are: ``gate`` and
``prior-mtp`` decode with a drafter that carries them (decode/unchecked.py).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..model import backbone
from ..model.heads import Gate, ResBlock, gate_hidden_size
from ..model.pointer import id_map
from .fit import _fit_gate, fit_small
from .mtp_data import Rows
from .rows_eval import chain_drafts, side_layers, targets

MAX_ROWS = 160  # held-out rows read (a seeded sample): ~15k anchors of 96-token rows


def fit_baselines(model, bundle, rows: Rows, seed: int = 0, steps: int = 300) -> dict:
    """Give ``bundle`` (design "mtp") a fitted gate and head 0 from the
    held-out ``rows``; their final losses and how many anchors they read
    ({} and no baselines when no row is long enough for every depth)."""
    h, agree, after = anchors(model, bundle, rows, seed)
    if h.shape[0] == 0:
        return {}
    d, k = bundle.config.hidden_size, bundle.k
    bundle.config.gate_hidden = gate_hidden_size(d, k)
    bundle.gate = Gate(d, k, bundle.config.gate_hidden)
    bundle.config.head0 = True
    bundle.head0 = ResBlock(d)
    out = {
        "anchors": int(h.shape[0]),
        "gate_loss": round(_fit_gate(bundle, h, agree, seed, steps), 4),
        "head0_loss": round(_fit_head0(model, bundle, h, after, seed, steps), 4),
        "gate_labels_right": np.asarray(agree).mean(axis=0).round(4).tolist(),
    }
    bundle.unfreeze()
    return out


def anchors(model, bundle, rows: Rows, seed: int = 0, batch_rows: int = 8):
    """At every anchor of up to :data:`MAX_ROWS` rows whose every depth lies
    inside the row's greedy continuation: ``h`` (n, d), whether each depth's
    draft is right (n, k), and the row's t+1 (n,)."""
    k, hs, rights, nexts = bundle.k, [], [], []
    chosen = np.random.default_rng([seed, 7]).permutation(len(rows))[:MAX_ROWS]
    for start in range(0, len(chosen), batch_rows):
        idx = np.sort(chosen[start : start + batch_rows])
        hidden, tokens, starts, ends = rows.gather(idx, k, bool(side_layers(bundle, rows)))
        drafts, _ = chain_drafts(model, bundle, mx.array(hidden), mx.array(np.maximum(tokens, 0)))
        target, inside = targets(tokens, starts, ends, rows.length, k)
        right = (drafts == target) & inside
        for r in range(len(idx)):
            span = np.arange(starts[r] - 1, ends[r] - 1 - k)
            hs.append(hidden[r, span, : model.args.hidden_size])
            rights.append(right[r, span])
            nexts.append(tokens[r, span + 1])
    h, right, after = (np.concatenate(x) for x in (hs, rights, nexts))
    return mx.array(h, dtype=mx.float32), right, after


def _fit_head0(model, bundle, h, after, seed: int, steps: int) -> float:
    """Head 0 alone, a cross-entropy over the draft vocabulary (the whole
    vocabulary without one) against the row's t+1; its final loss."""
    vocab = bundle.draft_vocab if "draft_vocab" in bundle else None
    w = backbone.output_rows(model, vocab).astype(mx.float32)
    mapped = id_map(None if vocab is None else np.array(vocab), bundle.config.vocab_size)[after]
    keep = mapped >= 0
    bundle.freeze()
    bundle.head0.unfreeze()

    def loss(b):
        return nn.losses.cross_entropy(bundle.head0(b["h"]) @ w.T, b["y"], reduction="mean")

    data = {"h": h[mx.array(np.flatnonzero(keep))], "y": mx.array(mapped[keep])}
    return fit_small(bundle, loss, data, steps, seed=seed)
