"""How many drafts verify should feed: CLP's odds against the price of a wide pass.

Feeding m drafts costs a backbone pass over m+1 tokens. On a GPU that is
nearly the price of one token; on a CPU it is not (here, fp32 0.5B: 1.28x for
2 tokens, 1.86x for 4). With CLP's probabilities P(L = l) for the run of
correct drafts, feeding m drafts commits 1 + E[min(L, m)] tokens, and
E[min(L, m)] = sum_{j<=m} P(L >= j). ``feed="cost"`` feeds the m that
maximises committed tokens per unit of pass time. Pass costs are measured
once per backbone, device and BLAS (a few passes on a scratch cache, about a
second on the 0.5B) and kept in ``pass_costs.json`` in the model cache.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..model.backbone import hidden_states, project, quantization, signature
from ..native import status as native_status
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
    quantization (its copies share the weights' fingerprint), device, BLAS."""
    sig = signature(model)
    native = native_status()
    # CLP_MLX_BLAS names the setup even when it failed to load: keys on disk stay as they were.
    blas = os.environ.get("CLP_MLX_BLAS") or ("openblas" if native.loaded else "default")
    blas += "+few_rows" if native.few_rows else ""
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

    The median of ``repeats`` after one warm-up pass per width, measured once
    per setup (see :func:`_setup_key`) and remembered in memory and on disk.
    """
    key = _setup_key(model)
    if len(_measured.get(key, [])) < widths:
        _measured[key] = _read_costs().get(key, [])
    if len(_measured[key]) >= widths:
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
    _write_costs({**_read_costs(), key: _measured[key]})
    return _measured[key]
