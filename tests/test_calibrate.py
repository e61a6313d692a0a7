"""Calibrating the MTP layer's chances (clp_mlx.train.calibrate): the fitted
temperature follows how sure the layer is, the drafts stay the same, and
train_mtp ships the temperatures that decoding then uses."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mtp_helpers import trained

from clp_mlx.api import load_with_drafter
from clp_mlx.decode.drafters import PassDrafts
from clp_mlx.decode.mtp_drafter import MTPDrafter, draft_chance, run_scores
from clp_mlx.train.calibrate import GRID, calibrate
from clp_mlx.train.mtp_data import Rows
from clp_mlx.train.rows_eval import chain_drafts


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return trained(tmp_path_factory.mktemp("calibrate"))


def drafts_of(model, bundle, rows):
    hidden, tokens, _, _ = rows.gather(np.arange(len(rows)), bundle.k)
    return chain_drafts(model, bundle, mx.array(hidden), mx.array(np.maximum(tokens, 0)))


def test_sharper_scores_get_a_proportionally_higher_temperature(root):
    """Scores twice as large (the same drafts, twice as sure) are fitted a
    temperature about twice as high, within a step of the grid."""
    model, _, bundle = load_with_drafter(root / "tiny", root / "m" / "drafter")
    rows = Rows.of([root / "data"], heldout=True)
    slice_ = bundle._draft_slice
    own = slice_.weight(model, bundle.draft_vocab)
    drafts, fits = drafts_of(model, bundle, rows)[0], []
    for scale in (0.25, 0.5):
        slice_._rows = scale * own
        fits.append(calibrate(model, bundle, rows)["t+2"])
        assert np.array_equal(drafts_of(model, bundle, rows)[0], drafts)
    low, high = (f["temperature"] for f in fits)
    assert GRID[0] < low and high < GRID[-1], "the test needs fits inside the grid"
    assert 2 / 1.16 <= high / low <= 2 * 1.16
    assert fits[0]["cases"] == fits[1]["cases"] > 0


def test_larger_data_is_fitted_on_every_nth_anchor(root, monkeypatch):
    """Above MAX_ANCHORS anchors, the fit reads every n-th anchor of each row:
    fewer cases, the same drafts scored, a temperature on the grid."""
    from clp_mlx.train import calibrate as module

    model, _, bundle = load_with_drafter(root / "tiny", root / "m" / "drafter")
    rows = Rows.of([root / "data"], heldout=True)
    every = module.fit_temperatures(model, bundle, rows)["t+2"]
    monkeypatch.setattr(module, "MAX_ANCHORS", len(rows) * rows.length // 3)
    third = module.fit_temperatures(model, bundle, rows)["t+2"]
    assert 0 < third["cases"] < every["cases"] / 2
    assert third["temperature"] in GRID


def test_the_shipped_drafter_decodes_with_its_temperatures(root):
    """train_mtp writes one temperature a depth and its report; the
    drafter's scores after a pass are the run chances at those temperatures."""
    folder = root / "m" / "drafter"
    temps = json.loads((folder / "heads.json").read_text())["temperatures"]
    report = json.loads((folder / "training.json").read_text())["calibration"]
    assert len(temps) == 2 and temps == [report["t+2"]["temperature"], report["t+3"]["temperature"]]
    model, _, bundle = load_with_drafter(root / "tiny", folder)
    assert bundle.config.temperatures == temps
    bundle.config.temperatures = [3.0, 0.5]  # far from the fit: the scores must follow
    drafter = MTPDrafter(model, bundle)
    hidden = mx.random.normal((5, model.args.hidden_size))
    drafter.prompt(hidden[:4], mx.array([5, 9, 17, 3]))
    scores = drafter.observe([8], PassDrafts(None, None, None, fed=hidden[4:]))
    assert len(scores) == 3 and np.isfinite(scores).all()
    probs = np.exp(np.array(scores))
    assert probs.sum() == pytest.approx(1.0, abs=1e-5)
    # the same chances at temperature 1 differ: the temperatures are read
    bundle.config.temperatures = []
    again = MTPDrafter(model, bundle)
    again.prompt(hidden[:4], mx.array([5, 9, 17, 3]))
    assert not np.allclose(again.observe([8], PassDrafts(None, None, None, fed=hidden[4:])), scores)


def test_draft_chance_is_the_softmax_of_the_best_at_a_temperature():
    scores = mx.array([[2.0, 0.0, -1.0], [0.5, 3.0, 0.5]])
    for t in (0.5, 1.0, 2.0):
        e = np.exp(np.array(scores) / t)
        want = np.max(e / e.sum(-1, keepdims=True), -1)
        np.testing.assert_allclose(np.array(draft_chance(scores, t)), want, rtol=1e-5)
    assert np.allclose(np.exp(np.array(run_scores(mx.array([[0.5, 0.5]])))), [[0.5, 0.25, 0.25]])
