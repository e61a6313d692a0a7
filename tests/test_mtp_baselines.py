"""The gate and head 0 baselines on the MTP layer (clp_mlx.train.mtp_baselines):
train_mtp fits them on held-out rows and ships them, and the paper's `gate`
and `prior-mtp` modes decode with that drafter."""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode_pairs
from mtp_helpers import trained

from clp_mlx.api import load_with_drafter
from clp_mlx.decode.steps import DecodeStats
from clp_mlx.train import mtp_baselines as module
from clp_mlx.train.mtp_baselines import anchors, fit_baselines
from clp_mlx.train.mtp_data import Rows


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return trained(tmp_path_factory.mktemp("baselines"), steps=20)


def test_train_mtp_ships_a_fitted_gate_and_head0(root):
    folder = root / "m" / "drafter"
    report = json.loads((folder / "training.json").read_text())["baselines"]
    assert report["anchors"] > 0 and len(report["gate_labels_right"]) == 2
    model, _, bundle = load_with_drafter(root / "tiny", folder)
    assert "gate" in bundle and "head0" in bundle
    # fitted, not as initialised: head 0 starts as the identity (zero weight)
    assert mx.abs(bundle.head0.linear.weight).max().item() > 0


def test_the_gate_learns_which_drafts_are_right(root, monkeypatch):
    """Labels the gate can read from h (depth 1 right where h's first unit
    is positive): after the fit its decisions follow them."""
    model, _, bundle = load_with_drafter(root / "tiny", root / "m" / "drafter")
    rows = Rows.of([root / "data"], heldout=True)
    h, right, after = anchors(model, bundle, rows)
    assert h.shape[0] == right.shape[0] == after.shape[0] > 20
    assert right.shape[1] == bundle.k and np.all(after >= 0)
    planted = np.array(h[:, 0] > 0)[:, None].repeat(bundle.k, axis=1)
    monkeypatch.setattr(module, "anchors", lambda *a, **k: (h, planted, after))
    fit_baselines(model, bundle, rows, steps=200)
    said = np.array(mx.sigmoid(bundle.gate(h))[:, 0] > 0.5)
    assert (said == planted[:, 0]).mean() > 0.9


def test_gate_and_prior_mtp_decode_with_the_layer(root):
    model, _, bundle = load_with_drafter(root / "tiny", root / "m" / "drafter")
    for mode in ("gate", "prior-mtp"):
        stats = DecodeStats(mode, bundle.k)
        out = [t for t, _ in decode_pairs([5, 9, 17], model, bundle, mode=mode, max_tokens=20,
                                          stats=stats)]  # fmt: skip
        assert len(out) == 20 and stats.tokens == 20 and sum(stats.accepted) == stats.steps
