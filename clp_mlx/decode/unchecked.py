"""The paper's modes: commit drafts without checking them.

    clp        backbone token + the first n drafts, n from CLP (the paper).
    fixed      backbone token + all drafts.
    gate       backbone token + the drafts the ~1M-parameter gate accepts.
    prior-mtp  head 0's guess replaces the backbone token (the failure mode
               the paper diagnoses), plus the drafts CLP accepts.

Sampling replaces each argmax by a draw (the backbone's token from p, head
0's in prior-mtp, draft i from q_i); these modes change the distribution
wherever the drafts are wrong, at any temperature.
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx

from ..model.backbone import hidden_states, project
from ..model.heads import accept_count
from .drafters import PassDrafts
from .steps import Step


def unchecked_step(model, heads, drafter, tokens, cache, config, sampler):
    """One pass: (the backbone's token b (1,), in-pass drafts (k,) or None,
    the commit count n from the graph, the drafter's part of the pass)."""
    fed = hidden_states(model, tokens, cache)
    h = fed[-1:]  # only the last position drafts
    first = heads.head0(h) if config.mode == "prior-mtp" else h
    b = sampler(project(model, first))
    got = PassDrafts(h, heads.clp_logits(h[0]), None, fed=fed)  # CLP's scores at h
    d = drafter.draft(h, b, None if sampler.greedy else sampler)[0][0] if drafter.in_pass else None
    if config.mode == "fixed":
        n = mx.array([config.draft_len])
    elif config.mode == "gate":
        n = mx.minimum(heads.gate_length(h, config.gate_threshold), config.draft_len)
    else:  # clp, prior-mtp
        n = mx.minimum(accept_count(got.scores, config.clp_threshold), config.draft_len)[None]
    return b, d, n, got


def _evaluated(out) -> None:
    b, d, n, got = out
    mx.async_eval(b, n, got.scores, got.h, *([] if d is None else [d]))


def unchecked(model, heads, drafter, first, cache, config, sampler) -> Iterator[Step]:
    """clp / fixed / gate / prior-mtp, one pass per step."""
    produced, budget = 0, config.max_tokens
    out = unchecked_step(model, heads, drafter, first, cache, config, sampler)
    while True:
        b, d, n, got = out
        b, n = b.item(), n.item()
        if d is not None:
            drafts = d.tolist()
            drafter.extend([b])
        else:  # drafted after the pass: its scores are CLP's (fixed and gate decided already)
            scores = drafter.observe([b], got)
            if config.mode in ("clp", "prior-mtp"):
                n = accept_count(mx.array(scores), config.clp_threshold).item()
                n = min(n, config.draft_len)
            drafts = drafter.candidates(drafter.k, 1)[0] if n else []
        n = min(n, budget - produced - 1)
        committed = [b] + drafts[:n]
        drafter.extend(drafts[:n])
        produced += len(committed)
        if produced < budget:
            tokens = mx.array(committed, dtype=mx.uint32)
            out = unchecked_step(model, heads, drafter, tokens, cache, config, sampler)
            _evaluated(out)
        from_draft = (config.mode == "prior-mtp",) + (True,) * n
        yield Step(tuple(committed), from_draft, n)
        if produced >= budget:
            return
