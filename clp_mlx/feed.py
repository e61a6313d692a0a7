"""How many drafts verify should feed: CLP's odds against the price of a wide pass.

Feeding m drafts costs a backbone pass over m+1 tokens. On a GPU that is
nearly the price of one token; on a CPU it is not (here, fp32 0.5B: 1.28x for
2 tokens, 1.86x for 4). With CLP's probabilities P(L = l) for the run of
correct drafts, feeding m drafts commits 1 + E[min(L, m)] tokens, and
E[min(L, m)] = sum_{j<=m} P(L >= j). ``feed="cost"`` feeds the m that
maximises committed tokens per unit of pass time. Pass costs are measured
once per model (a few passes on a scratch cache) unless given.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from .backbone import hidden_states, project

_measured: dict[int, list[float]] = {}


def best_feed(probs: list[float], costs: list[float], m_max: int) -> int:
    """The draft count in 0..m_max with the most expected tokens per pass time.

    ``probs``: CLP's P(L = l), l = 0..k; ``costs[m]``: time of a pass over
    m + 1 tokens (any unit).
    """
    best, best_rate, expected = 0, 1.0 / costs[0], 1.0
    for m in range(1, min(m_max, len(costs) - 1, len(probs) - 1) + 1):
        expected += sum(probs[m:])  # P(L >= m): draft m is accepted
        rate = expected / costs[m]
        if rate > best_rate:
            best, best_rate = m, rate
    return best


def pass_costs(model, widths: int, *, context: int = 64, repeats: int = 3) -> list[float]:
    """Seconds for a backbone pass (with projection) over 1..``widths`` tokens.

    Measured once per model object and remembered; the median of ``repeats``
    after one warm-up pass per width.
    """
    key = id(model)
    if key in _measured and len(_measured[key]) >= widths:
        return _measured[key][:widths]
    cache = make_prompt_cache(model)
    hidden_states(model, mx.zeros((context,), dtype=mx.uint32), cache)
    mx.eval([c.state for c in cache])
    times = [[] for _ in range(widths)]
    for r in range(repeats + 1):
        for n in range(1, widths + 1):
            tic = time.perf_counter()
            mx.eval(project(model, hidden_states(model, mx.zeros((n,), dtype=mx.uint32), cache)))
            if r:
                times[n - 1].append(time.perf_counter() - tic)
            for c in cache:
                c.trim(n)
    _measured[key] = [statistics.median(t) for t in times]
    return _measured[key]
