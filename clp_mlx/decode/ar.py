"""Plain decoding: one token per backbone pass, token for token what mlx-lm writes."""

from __future__ import annotations

from typing import Iterator

import mlx.core as mx

from ..model.backbone import hidden_states, project
from .steps import Step


def ar(model, first: mx.array, cache, max_tokens: int, sampler) -> Iterator[Step]:
    def step(tokens):
        logits = project(model, hidden_states(model, tokens, cache)[-1:])
        return sampler(logits), logits

    # As mlx-lm: queue step n+1 before handing out token n, so the host work
    # of the caller overlaps the next forward pass.
    y, logits = step(first)
    mx.async_eval(y)
    for n in range(max_tokens):
        nxt = step(y) if n + 1 < max_tokens else None
        if nxt is not None:
            mx.async_eval(nxt[0])
        yield Step((y.item(),), (False,), 0, logits=logits)
        if nxt is not None:
            y, logits = nxt
