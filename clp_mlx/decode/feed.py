"""How many drafts verify should feed: CLP's odds against the price of a wide pass.

Feeding m drafts costs a backbone pass over m+1 tokens. On a GPU that is
nearly the price of one token; on a CPU it is not (here, fp32 0.5B with the
few-row kernel: about 1.1x for 2 tokens, 1.55x for 4). With CLP's
probabilities P(L = l) for the run of correct drafts, feeding m drafts
commits 1 + E[min(L, m)] tokens, and E[min(L, m)] = sum_{j<=m} P(L >= j).
``feed="cost"`` feeds the m that maximises committed tokens per unit of pass
time; a drafter that drafts depth by depth (the MTP layer) stops where no
deeper draft could change that choice (:func:`deeper_cannot_pay`). Pass costs are measured
once per backbone, device and BLAS (a few passes on a scratch cache, about a
second on the 0.5B) and kept in ``pass_costs.json`` in the model cache.

Costs measured while another job held the cores are wrong, and stay wrong if
kept: one such entry here said a 4-token pass of the 0.5B cost 1.06x a
1-token one (it costs 1.5x) and its 1-token pass 5x what it takes, so verify
fed every draft. So each time is the fastest of its repeats (another job
only adds time), and a process that finds costs on disk first times one
1-token pass: if the stored one is over :data:`STALE` times slower, the
costs are measured again.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..model.backbone import hidden_states, project, quantization, signature
from ..native import status as native_status
from ..native.few_rows import source_key
from ..native.padrows import is_padded
from ..paths import cache_root, write_text

_measured: dict[str, list[float]] = {}  # by setup, as on disk; see forget_measured()


def forget_measured() -> None:
    """Forget the pass costs held in memory, as a new process would: the next
    :func:`pass_costs` reads the file (or measures) again."""
    _measured.clear()


def _costs_file() -> Path:
    return cache_root() / "pass_costs.json"


def _setup_key(model) -> str:
    """What pass times depend on: the backbone's weights and shape, dtype,
    quantization (its copies share the weights' fingerprint), device, BLAS
    and the few-row kernel's version."""
    sig = signature(model)
    native = native_status()
    # CLP_MLX_BLAS names the setup even when it failed to load: keys on disk stay as they were.
    blas = os.environ.get("CLP_MLX_BLAS") or ("openblas" if native.loaded else "default")
    blas += f"+few_rows-{source_key()}" if native.few_rows else ""
    blas += "+pad16" if is_padded(model) else ""
    dtype = str(model.model.norm.weight.dtype)
    dtype += f" {quantization(model)}" if quantization(model) else ""  # float keys as before
    return f"{sig['fingerprint']}|{sig['num_layers']}x{sig['hidden_size']}|{dtype}|{mx.default_device()}|{blas}"


def _read_costs() -> dict:
    """The pass times on disk; entries that are not lists of positive times
    (a damaged or foreign file) are dropped and measured again."""
    try:
        table = json.loads(_costs_file().read_text())
    except (OSError, ValueError, RecursionError):
        return {}  # none yet, or unreadable: measure again
    if not isinstance(table, dict):
        return {}
    return {key: times for key, times in table.items() if _are_times(times)}


def _are_times(times) -> bool:
    return isinstance(times, list) and all(
        isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < float("inf")
        for t in times
    )


def _write_costs(table: dict) -> None:
    try:
        write_text(_costs_file(), json.dumps(table, indent=1))
    except OSError:
        pass  # a read-only cache only means measuring again next time


def best_feed(probs: list[float], costs: list[float], m_max: int) -> int:
    """The draft count in 0..m_max with the most expected tokens per pass time.

    ``probs``: CLP's P(L = l), l = 0..k; ``costs[m]``: time of a pass over
    m + 1 tokens (any unit). Feeding m drafts commits 1 + sum_{j<=m} P(L >= j)
    tokens on average: :func:`best_tree` with no alternatives.
    """
    return best_tree(probs, [], costs, m_max)[0]


def best_tree(probs: list[float], alternatives, costs: list[float], m_max: int):
    """As :func:`best_feed`, with the drafter's alternatives as leaves: the
    draft count m and the leaves ``(depth, token)`` with the most expected
    tokens per pass time.

    A fed node commits a token when it is on the accepted path: draft j with
    chance P(L >= j); an alternative at depth j (a sibling of draft j) when
    drafts 1..j-1 are accepted and it is the backbone's token, P(L >= j - 1)
    times its own chance. So the best n nodes to feed are the n likeliest
    (EAGLE-2 reranks its draft tree the same way), and as no node is likelier
    than its parent, they form a tree. ``alternatives``: per depth, (token,
    chance) pairs (:meth:`.drafters.Drafter.alternatives`).
    """
    alive = [0.0] * (len(probs) + 1)  # P(L >= j), summed from the end: never rising
    for j in reversed(range(len(probs))):
        alive[j] = alive[j + 1] + probs[j]
    top = min(m_max, len(probs) - 1)
    nodes = [(alive[j], 0, j, None) for j in range(1, top + 1)]
    nodes += [
        (alive[j - 1] * min(p, 1.0), 1, j, t)
        for j, pairs in enumerate(alternatives[:top], 1)
        for t, p in pairs
    ]
    nodes.sort(key=lambda node: (-node[0], node[1], node[2]))  # parents first on ties
    best, best_rate, expected = 0, 1.0 / costs[0], 1.0
    for n, node in enumerate(nodes[: len(costs) - 1], 1):
        expected += node[0]
        if expected / costs[n] > best_rate:
            best, best_rate = n, expected / costs[n]
    chosen = nodes[:best]
    m = sum(1 for node in chosen if not node[1])
    return m, [(j, t) for _, leaf, j, t in chosen if leaf]


def deeper_cannot_pay(alive: list[float], costs: list[float]) -> bool:
    """Whether no feed of more than ``d`` drafts can beat the best of 0..d,
    with ``alive[j]`` = P(L >= j) known for j = 0..d (``alive[0]`` = 1) and
    ``costs`` as in :func:`best_feed`, up to the deepest feed possible.

    Each draft after the d-th is accepted with chance at most ``alive[d]``,
    so feeding m > d commits at most ``1 + E[min(L, d)] + (m - d) alive[d]``
    tokens. When even that is no better per unit of time (:func:`best_feed`
    moves only on a strictly better rate), the deeper drafts cannot change
    its choice: a drafter may stop drafting there.
    """
    d = len(alive) - 1
    expected = [sum(alive[: m + 1]) for m in range(min(d + 1, len(costs)))]
    best = max(e / c for e, c in zip(expected, costs))
    return all(
        (expected[d] + (m - d) * alive[d]) / costs[m] <= best for m in range(d + 1, len(costs))
    )


def depth_rule(model, config, k: int):
    """For a drafter of ``k`` depths: a function of the chances so far that
    says when to stop drafting (:func:`deeper_cannot_pay`), or None where
    the feed does not follow the pass costs (only verify's does)."""
    if config.mode != "verify" or config.feed != "cost":
        return None
    costs = pass_costs(model, config.draft_len + 1)[: k + 1]  # the widths verify asks for
    return lambda alive: deeper_cannot_pay(alive, costs)


STALE = 1.5  # a stored 1-token pass this many times slower than one now is measured again


def pass_costs(model, widths: int, *, context: int = 64, repeats: int = 5) -> list[float]:
    """Seconds for a backbone pass (with projection) over 1..``widths`` tokens.

    The fastest of ``repeats`` after one warm-up pass per width, the widths
    interleaved, measured once per setup (see :func:`_setup_key`) and
    remembered in memory and on disk (checked once per process: above).
    """
    key = _setup_key(model)
    if len(_measured.get(key, [])) < widths:
        stored = _read_costs().get(key, [])
        if len(stored) >= widths and stored[0] > STALE * one_pass_now(model):
            stored = []  # measured under load: measure again
        _measured[key] = stored
    if len(_measured[key]) >= widths:
        return _measured[key][:widths]
    _measured[key] = [min(t) for t in _times(model, widths, context, repeats)]
    _write_costs({**_read_costs(), key: _measured[key]})
    return _measured[key]


def one_pass_now(model, context: int = 8) -> float:
    """Seconds for a 1-token pass now (the faster of two, after a warm-up)."""
    return min(_times(model, 1, context, 2)[0])


def _times(model, widths: int, context: int, repeats: int) -> list[list[float]]:
    """Per width 1..``widths``, ``repeats`` pass times on a scratch cache of ``context``."""
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
    return times
