"""Lossless sampling: speculative sampling of the drafts, checked in the pass that feeds them.

Same schedule as :mod:`.verify`. Drafts are drawn from the drafter's
distribution q; the pass gives the backbone's p at every fed position, and
:func:`.sampling.accept_drafts` keeps draft x with probability
min(1, p(x)/q(x)), replacing the first refused one by a draw from the
normalised residual max(0, p - q). The tokens are distributed exactly as
``ar`` sampling's. The (k, V) distributions q stay on the device and feed the
next step's acceptance test.

A drafter that drafts after the pass (copies from the context) proposes
once the step's tokens are known (:func:`verify_sampled_after`). A copied
token x is a point mass, q = 1 at x: it is accepted with probability p(x),
and on refusal the token is drawn from p with x removed and renormalised,
which is the same rule with that q.
"""

from __future__ import annotations

from typing import Iterator

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from ..model.backbone import hidden_states, project
from .feed import pass_costs
from .sampling import accept_drafts
from .steps import Step
from .verify import feed_count


def sampled_pass(model, drafter, fed: mx.array, q_fed, cache, sampler):
    """Check the drafts in ``fed`` (token t first) and draw the next ones.

    Returns lazily ([a, the next token, its drafts], their q (k, V), the
    backbone's logits (m+1, V)).
    """
    h = hidden_states(model, fed, cache)  # (m+1, d)
    backbone_logits = project(model, h)
    p = sampler.log_probs(backbone_logits)  # (m+1, V)
    a, b = accept_drafts(p, q_fed, fed[1:], sampler.next_key())
    # Only the row after the last accepted token drafts: k projected rows,
    # not (m+1)k, and drafters can see the token just drawn.
    d, logits = drafter.draft(h[a][None], b[None], sampler)
    d, q = d[0], sampler.log_probs(logits[0])  # (k,), (k, V)
    return mx.concatenate([a[None].astype(mx.uint32), b[None], d]), q, backbone_logits


def verify_sampled(model, drafter, first, cache, config, sampler) -> Iterator[Step]:
    produced, budget = 0, config.max_tokens
    fed = [None]
    out, q, logits = sampled_pass(model, drafter, first, None, cache, sampler)
    while True:
        rows = logits
        host = out.tolist()
        m = len(fed) - 1
        a, b, drafts = host[0], host[1], host[2:]
        committed = (fed[1 : 1 + a] + [b])[: budget - produced]
        trim_prompt_cache(cache, m - a)  # rejected drafts leave the cache
        produced += len(committed)
        if produced < budget:
            m_next = min(config.draft_len, budget - produced - 1)
            fed = [b] + drafts[:m_next]
            out, q, logits = sampled_pass(
                model, drafter, mx.array(fed, dtype=mx.uint32), q[:m_next], cache, sampler
            )
            mx.async_eval(out)
        drafted = tuple(i < a for i in range(len(committed)))
        yield Step(tuple(committed), drafted, len(committed) - 1, m, rows[: len(committed)])
        if produced >= budget:
            return


def point_masses(drafts: mx.array, vocab: int) -> mx.array:
    """log q (m, V) of drafts each drawn with certainty: 0 at the draft, -inf elsewhere."""
    return mx.where(mx.arange(vocab)[None] == drafts[:, None], 0.0, -mx.inf)


def after_pass(model, drafter, fed: list[int], lq, cache, sampler):
    """Check the drafts in ``fed`` (token t first): lazily ([a, the next
    token], the drafter's part of the pass at the accepted token, the
    backbone's logits)."""
    tokens = mx.array(fed, dtype=mx.uint32)
    h = hidden_states(model, tokens, cache)
    logits = project(model, h)
    p = sampler.log_probs(logits)
    drafts = tokens[1:]
    if lq is None and drafts.size:
        lq = point_masses(drafts, p.shape[-1])
    a, b = accept_drafts(p, lq, drafts, sampler.next_key())
    # The token after each fed one: the next fed token, and b after the accepted one.
    after = mx.where(mx.arange(tokens.size) == a, b, mx.concatenate([drafts, b[None]]))
    out = mx.stack([a.astype(mx.uint32), b.astype(mx.uint32)])
    return out, drafter.at(h, after, a), logits


def verify_sampled_after(model, drafter, first, cache, config, sampler) -> Iterator[Step]:
    """Sampled verify for a drafter that proposes after the pass (``in_pass`` False)."""
    costs = pass_costs(model, config.draft_len + 1) if config.feed == "cost" else None
    produced, budget = 0, config.max_tokens
    fed = [first.item()]
    out, got, logits = after_pass(model, drafter, fed, None, cache, sampler)
    while True:
        rows = logits
        a, b = out.tolist()
        m = len(fed) - 1
        committed = (fed[1 : 1 + a] + [b])[: budget - produced]
        trim_prompt_cache(cache, m - a)  # rejected drafts leave the cache
        produced += len(committed)
        if produced < budget:
            depth = min(config.draft_len, budget - produced - 1)
            n = feed_count(drafter.observe(committed, got), depth, config.feed, costs)
            drafts, logits = drafter.proposal(n, sampler) if n else ([], None)
            lq = None if logits is None else sampler.log_probs(logits)
            fed = [b] + drafts
            out, got, logits = after_pass(model, drafter, fed, lq, cache, sampler)
            mx.async_eval(out, *got.lazy())
        drafted = tuple(i < a for i in range(len(committed)))
        yield Step(tuple(committed), drafted, len(committed) - 1, m, rows[: len(committed)])
        if produced >= budget:
            return
