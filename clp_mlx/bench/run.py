"""The benchmark: every method on every prompt, interleaved, and its figures."""

from __future__ import annotations

import math
import statistics

import mlx.core as mx
from tqdm import tqdm

from .measures import common_prefix, continuation_nll, repetition_ratio
from .methods import LOSSLESS, WARMUP_TOKENS, Start, run_one


def bench(
    model, heads, prompts, methods, *, max_tokens, repeats=1, draft=None, draft_tokens=3,
    progress=True,
):
    """Run ``methods`` on each prompt (token id lists); return method -> figures.
    ``progress``: a bar on stderr, one tick per prompt, repeat and method."""
    methods = ["ar", *(m for m in dict.fromkeys(methods) if m != "ar")]
    kw = {"draft": draft, "draft_tokens": draft_tokens}
    drafting = draft if "mlx-lm-draft" in methods else None
    start = Start.prefill(model, prompts[0], drafting, heads)
    for m in methods:  # warm-up: first-call costs stay out of the figures
        run_one(model, heads, start, m, min(WARMUP_TOKENS, max_tokens), **kw)
    runs = {m: [] for m in methods}
    nll, prefills = {}, []  # quality after each prompt's timing; lossless outputs share a pass
    total = len(prompts) * repeats * len(methods)
    bar = tqdm(total=total, desc="bench", unit="run", disable=not progress, leave=False)
    for i, ids in enumerate(prompts):
        start = Start.prefill(model, ids, drafting, heads)
        prefills.append(start.seconds)
        for _ in range(repeats):
            for m in methods:
                bar.set_postfix_str(f"prompt {i + 1}/{len(prompts)}, {m}")
                runs[m].append((i, run_one(model, heads, start, m, max_tokens, **kw)))
                bar.update()
        for m in methods:
            for j, r in runs[m]:
                key = (j, tuple(r.tokens))
                if j == i and key not in nll:
                    nll[key] = continuation_nll(model, ids, r.tokens, start)
        del start
        mx.clear_cache()
    bar.close()
    prefill_s = round(statistics.median(prefills), 4)
    return {m: {**_figures(m, runs[m], runs["ar"], nll), "prefill_s": prefill_s} for m in methods}


def _figures(method, runs, ar_runs, nll) -> dict:
    pairs = [(r, a) for (_, r), (_, a) in zip(runs, ar_runs)]
    ratios = [r.tps / a.tps if a.tps > 0 else 0.0 for r, a in pairs]
    hist = [sum(c) for c in zip(*(r.accepted for _, r in runs))]
    n_tokens = sum(len(r.tokens) for _, r in runs)
    total_nll = sum(nll[(i, tuple(r.tokens))] for i, r in runs)
    by_prompt, tps = {}, {}  # prompt -> its repeats' ratios against ar, and tokens/s
    for ((i, r), _), ratio in zip(zip(runs, ar_runs), ratios):
        by_prompt.setdefault(i, []).append(ratio)
        tps.setdefault(i, []).append(r.tps)
    return {
        "lossless": method in LOSSLESS,
        "runs": len(runs),
        "decode_tps": round(statistics.median(r.tps for _, r in runs), 3),
        "first_token_s": round(statistics.median(r.first for _, r in runs), 4),
        "speedup": round(statistics.median(ratios), 3),
        "speedup_min": round(min(ratios), 3),
        "speedup_max": round(max(ratios), 3),
        # per prompt, the median over its repeats; and how far repeats of one
        # prompt spread ((max - min) / median tokens/s, the median over prompts)
        "prompt_speedups": [round(statistics.median(v), 3) for v in by_prompt.values()],
        "repeat_spread": round(statistics.median(_spread(v) for v in tps.values()), 3),
        "tokens_per_pass": round(statistics.mean(len(r.tokens) / r.steps for _, r in runs), 3),
        "accepted_histogram": hist,
        "repetition": round(statistics.mean(repetition_ratio(r.tokens) for _, r in runs), 4),
        "identical_to_ar": round(sum(r.tokens == a.tokens for r, a in pairs) / len(pairs), 3),
        "mean_common_prefix": round(
            statistics.mean(common_prefix(r.tokens, a.tokens) for r, a in pairs), 1
        ),
        "perplexity": round(math.exp(total_nll / max(n_tokens, 1)), 3),
        "peak_memory_gb": round(max(r.peak for _, r in runs) / 1e9, 3),
    }




def _spread(values: list) -> float:
    """(max - min) / median: how far repeated timings of one thing spread."""
    return (max(values) - min(values)) / max(statistics.median(values), 1e-9)
