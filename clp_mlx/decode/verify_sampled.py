"""Lossless sampling: speculative sampling of the drafts, checked in the pass that feeds them.

Same schedule as :mod:`.verify`. Drafts are drawn from the drafter's
distribution q; the pass gives the backbone's p at every fed position, and
:func:`.sampling.accept_drafts` keeps draft x with probability
min(1, p(x)/q(x)), replacing the first refused one by a draw from the
normalised residual max(0, p - q). The tokens are distributed exactly as
``ar`` sampling's. The (k, V) distributions q stay on the device and feed the
next step's acceptance test.
"""

from __future__ import annotations

from typing import Iterator

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from ..model.backbone import hidden_states, project
from .sampling import accept_drafts
from .steps import Step


def sampled_pass(model, drafter, fed: mx.array, q_fed, cache, sampler):
    """Check the drafts in ``fed`` (token t first) and draw the next ones.

    Returns lazily ([a, the next token, its drafts], their q (k, V)).
    """
    h = hidden_states(model, fed, cache)  # (m+1, d)
    p = sampler.log_probs(project(model, h))  # (m+1, V)
    a, b = accept_drafts(p, q_fed, fed[1:], sampler.next_key())
    # Only the row after the last accepted token drafts: k projected rows,
    # not (m+1)k, and drafters can see the token just drawn.
    d, logits = drafter.draft(h[a][None], b[None], sampler)
    d, q = d[0], sampler.log_probs(logits[0])  # (k,), (k, V)
    return mx.concatenate([a[None].astype(mx.uint32), b[None], d]), q


def verify_sampled(model, drafter, first, cache, config, sampler) -> Iterator[Step]:
    produced, budget = 0, config.max_tokens
    fed = [None]
    out, q = sampled_pass(model, drafter, first, None, cache, sampler)
    while True:
        host = out.tolist()
        m = len(fed) - 1
        a, b, drafts = host[0], host[1], host[2:]
        committed = (fed[1 : 1 + a] + [b])[: budget - produced]
        trim_prompt_cache(cache, m - a)  # rejected drafts leave the cache
        produced += len(committed)
        if produced < budget:
            m_next = min(config.draft_len, budget - produced - 1)
            fed = [b] + drafts[:m_next]
            out, q = sampled_pass(
                model, drafter, mx.array(fed, dtype=mx.uint32), q[:m_next], cache, sampler
            )
            mx.async_eval(out)
        drafted = tuple(i < a for i in range(len(committed)))
        yield Step(tuple(committed), drafted, len(committed) - 1, m)
        if produced >= budget:
            return
