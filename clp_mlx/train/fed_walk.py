"""Verify's walk as decoding feeds it, on rows whose greedy tokens are known.

``train --eval``'s plain walk feeds every draft (verify's ``feed="all"``).
Verify by default feeds what the pass costs say pays (decode/feed.py): a
chain of ``m`` of the MTP layer's drafts, its runners-up as leaves where
their chances pay, and no deeper drafting where nothing deeper could pay
(the depth rule). Those choices read the layer's chances, so two layers
with the same drafts can decode at different tokens a pass. This walk makes
the same choices at every anchor of the rows, from the same chances, with
the pass costs given: thousands of anchors, no timing. The drafter alone:
context copies are left out. Where verify feeds chains only (a setup whose
cache pads rows into trees, or ``tree=0``), ``leaves=False`` walks that.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..decode.feed import best_tree, deeper_cannot_pay
from ..decode.mtp_drafter import run_scores
from ..decode.verify import softmax


def fed_steps(run, drafts, target, alt_ids, alt_chances, costs, k, leaves=True):
    """Per pass along one row: (tokens committed, tokens fed beside the
    backbone's own). Per anchor: ``run`` the accepted chain, ``drafts`` and
    ``target`` (n, k), ``alt_ids`` / ``alt_chances`` (n, k, R) the layer's
    best R tokens at each depth and its chances of them (its draft's the
    highest); ``costs[w]`` the time of a pass over w + 1 tokens."""
    n, t, out = len(run), 0, []
    while t < n:
        # As decoding with the row's end as its budget: drafts stop a token short of
        # it (that one is a pass's own token), and the pass at the last token here
        # stands for decoding's first, which commits the prefill's token alone.
        depth = max(0, min(k, n - t - 2))
        p, alive, drafted = alt_chances[t].max(-1).tolist(), [1.0], k
        for d in range(k - 1):  # the depth rule, as MTPDrafter applies it
            alive.append(alive[-1] * p[d])
            if deeper_cannot_pay(alive, costs[: k + 1]):
                drafted = d + 1
                break
        probs = run_chances(p[:drafted] + [0.0] * (k - drafted))
        alternatives = []
        for d in range(drafted if leaves else 0):
            pairs = zip(alt_ids[t, d].tolist(), alt_chances[t, d].tolist())
            alternatives.append(sorted(((i, c) for i, c in pairs if i != drafts[t, d]),
                                       key=lambda x: -x[1]))  # fmt: skip
        m, fed = best_tree(probs, alternatives, costs, depth)
        m = min(m, drafted)  # undrafted depths (chance ~0) are never fed
        accepted = min(int(run[t]), m)
        if accepted < k and (accepted + 1, target[t, accepted]) in fed:
            accepted += 1  # a runner-up was the backbone's token
        out.append((1 + accepted, m + len(fed)))
        t += 1 + accepted
    return out


def run_chances(p: list[float]) -> list[float]:
    """P(L = l), l = 0..k, from each draft's chance once those before it are
    right, as verify reads them from the layer's run scores."""
    return softmax(run_scores(mx.array(p)).tolist())


def summary(steps: list[list[tuple[int, int]]], costs) -> dict:
    """Tokens a pass and a pass's time in one-token passes, over rows' steps."""
    flat = [s for row in steps for s in row]
    tokens = sum(s[0] for s in flat)
    time = sum(costs[s[1]] / costs[0] for s in flat)
    return {
        "tokens_per_pass": round(tokens / max(1, len(flat)), 3),
        "tokens_per_time": round(tokens / max(time, 1e-9), 3),
        "fed_per_pass": round(float(np.mean([s[1] for s in flat])) if flat else 0.0, 3),
    }
