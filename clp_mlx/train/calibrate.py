"""The MTP layer's chances of its drafts, calibrated: one temperature per depth.

The layer's CLP is its own chance of each run of accepted drafts
(:func:`..decode.mtp_drafter.run_scores`), from the probability its softmax
over the draft vocabulary gives each draft. Verify reads those chances to
choose how many drafts a pass feeds, and clp mode to choose how many it
commits unchecked; but a softmax trained on cross-entropy is overconfident
on rows it never saw. Measured on the 0.5B's recipe drafter, held-out
WikiText rows: it gave a run of 3 a chance of 0.20 where 0.10 came true.

So each depth gets the temperature ``T`` at which ``softmax(scores / T)``
of its draft best predicts, on held-out rows, whether that draft is right
when the drafts before it are (temperature scaling, as Guo et al. 2017,
"On Calibration of Modern Neural Networks"). The drafts stay the same.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .mtp_data import Rows
from .rows_eval import chain_drafts, side_layers, targets

MIN_CASES = 30  # fewer cases at a depth: keep its temperature at 1
GRID = tuple(round(1.15**i, 4) for i in range(-3, 23))  # 0.66 .. 21.6, with 1.0
# Anchors a fit looks at, about, at most: every n-th anchor of larger data.
# Each grid point is a log-sum-exp over the draft vocabulary at every case:
# on 325 held-out rows of the 0.5B at 16k draft tokens, every anchor took 20
# minutes; the one temperature a depth needs no more than ~10k cases.
MAX_ANCHORS = 12288


def fit_temperatures(model, bundle, rows: Rows, batch_rows: int = 8) -> dict:
    """Per depth, the temperature on :data:`GRID` of least log loss on
    ``rows`` (held-out rows), and how the chances compare with the drafts
    that were right there, before (``T`` = 1) and after."""
    k = bundle.k
    loss, seen_at = np.zeros((k, len(GRID))), [[] for _ in range(k)]
    every = -(-len(rows) * rows.length // MAX_ANCHORS)  # ceil, >= 1
    sampled = (np.arange(rows.length) % every == 0)[None, :]
    for start in range(0, len(rows), batch_rows):
        idx = np.arange(start, min(len(rows), start + batch_rows))
        hidden, tokens, starts, ends = rows.gather(idx, k, bool(side_layers(bundle, rows)))
        seen: list = []
        drafts, _ = chain_drafts(
            model, bundle, mx.array(hidden), mx.array(np.maximum(tokens, 0)), seen
        )
        target, inside = targets(tokens, starts, ends, rows.length, k)
        drafted_at = np.arange(rows.length)[None, :, None] >= starts[:, None, None] - 1
        inside &= drafted_at & sampled[..., None]  # where decoding drafts: from the prompt's end
        right = drafts == target
        before = np.concatenate([np.ones_like(right[..., :1]), right[..., :-1]], -1)
        earlier = np.cumprod(before, -1)  # the drafts before each one are right
        for j, scores in enumerate(seen):
            use = inside[..., j] & (earlier[..., j] > 0)
            if not use.any():
                continue
            cases = scores.reshape(-1, scores.shape[-1])[mx.array(np.flatnonzero(use))]
            top = mx.max(cases, axis=-1)
            logp = np.stack([np.array(top / t - mx.logsumexp(cases / t, axis=-1)) for t in GRID])
            y, lp = right[..., j][use], np.minimum(logp, -1e-7)
            loss[j] -= (y * lp + (1 - y) * np.log(-np.expm1(lp))).sum(-1)
            seen_at[j].append((y, lp))
    report, one = {}, GRID.index(1.0)
    for j in range(k):
        y = np.concatenate([np.zeros(0, bool), *(a for a, _ in seen_at[j])])
        lp = np.concatenate([np.zeros((len(GRID), 0)), *(b for _, b in seen_at[j])], axis=-1)
        best = int(np.argmin(loss[j])) if y.size >= MIN_CASES else one  # too few: as trained
        report[f"t+{j + 2}"] = {
            "temperature": GRID[best],
            "cases": int(y.size),
            "right": round(float(y.mean()), 4) if y.size else None,
            "chance_before": round(float(np.exp(lp[one]).mean()), 4) if y.size else None,
            "chance_after": round(float(np.exp(lp[best]).mean()), 4) if y.size else None,
        }
    return report


def calibrate(model, bundle, rows: Rows) -> dict:
    """Set ``bundle``'s temperatures from ``rows`` (held-out); the fit's report."""
    bundle.config.temperatures = []  # fit the layer's own chances, not earlier temperatures
    report = fit_temperatures(model, bundle, rows)
    bundle.config.temperatures = [report[f"t+{j + 2}"]["temperature"] for j in range(bundle.k)]
    return report
