"""Running the benchmarked methods: our decode modes and mlx-lm's two decoders.

Every method is timed the same way from the same start: a prompt is fed once
(all but its last token, timed: the prefill) into a cache of the backbone and
one of the draft model, and each method decodes from those caches, rewound to
the prompt after it. The clock starts before the generator is created, the
first token marks the first pass over the prompt's last token, and decode
speed is the remaining tokens over the time they took. No method stops at
EOS: each writes exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import math
import resource
import statistics
import sys
import time
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from ..decode.loop import MODES, DecodeStats, decode, prefill
from ..errors import ClpError

# verify: as generate runs it (feed by cost, context drafts, token trees where wide
# passes are padded); verify-all / verify-clp: feed every draft / what CLP expects to
# pass; verify-heads: no context drafts; verify-chain: no trees; clp-ctx: clp with
# context drafts (clp alone is the paper's: the heads' drafts).
OURS = (*MODES, "verify-all", "verify-clp", "verify-heads", "verify-chain", "clp-ctx")
PEERS = ("mlx-lm", "mlx-lm-draft")
METHODS = (*OURS, *PEERS)
LOSSLESS = ("ar", "verify", "verify-all", "verify-clp", "verify-heads", "verify-chain", *PEERS)
THRESHOLDED = ("clp", "clp-ctx", "prior-mtp")  # "clp@0.8": CLP's threshold rule
_VARIANTS = {  # suffix: (feed, lookup, tree)
    "": ("cost", None, None),
    "all": ("all", None, None),
    "clp": ("clp", None, None),
    "heads": ("cost", False, None),
    "chain": ("cost", None, 0),
    "ctx": ("cost", True, None),
}
DEFAULT_MODES = ("ar", "verify", "clp", "fixed")
WARMUP_TOKENS = 8


def parse_method(method: str) -> tuple[str, float | None]:
    """``"clp@0.8"`` -> ("clp", 0.8): a method and its CLP threshold, checked."""
    base, at, q = method.partition("@")
    if base not in METHODS or (at and base not in THRESHOLDED):
        raise ClpError(
            f"unknown method {method!r}; choose from {', '.join(METHODS)} "
            f"({', '.join(THRESHOLDED)} take @THRESHOLD, e.g. clp@0.8)"
        )
    if not at:
        return base, None
    try:
        value = float(q)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise ClpError(f"{method!r}: the threshold after @ must be a number in (0, 1]")
    return base, value


def needs_heads(method: str) -> bool:
    base = parse_method(method)[0]
    return base in OURS and base != "ar"


@dataclass
class Run:
    """One timed generation."""

    tokens: list
    tps: float  # decode tokens/s, from the first token on
    first: float  # seconds to the first token, from the prefilled prompt
    steps: int  # backbone (target model) passes
    accepted: list  # accepted[n]: passes that committed n drafts
    peak: float  # bytes, see peak_memory_source()


@dataclass
class Start:
    """A prompt fed once: caches holding all but its last token."""

    ids: list
    cache: list  # the backbone's
    draft_cache: list | None  # the draft model's, for mlx-lm-draft
    seconds: float  # the backbone's prefill

    @classmethod
    def prefill(cls, model, ids: list, draft=None) -> Start:
        prompt = mx.array(ids, dtype=mx.uint32)
        tic = time.perf_counter()
        cache = make_prompt_cache(model)
        prefill(model, prompt, cache)
        seconds = time.perf_counter() - tic
        draft_cache = None
        if draft is not None:
            draft_cache = make_prompt_cache(draft)
            prefill(draft, prompt, draft_cache)
        return cls(list(ids), cache, draft_cache, seconds)

    def rewind(self) -> None:
        """Drop what a method added after the prompt."""
        for c in (self.cache, self.draft_cache):
            if c is not None:
                trim_prompt_cache(c, c[0].offset - (len(self.ids) - 1))


def _ours(model, heads, start, mode, max_tokens):
    k = heads.k if heads is not None and mode != "ar" else 0
    stats = DecodeStats(mode, k)
    base, threshold = parse_method(mode)
    kind, variant = (base, "") if base in MODES else base.split("-", 1)
    feed, lookup, tree = _VARIANTS[variant]
    gen = decode(
        start.ids[-1:],
        model,
        heads,
        mode=kind,
        max_tokens=max_tokens,
        prompt_cache=start.cache,
        stats=stats,
        feed=feed,
        lookup=lookup,
        clp_threshold=threshold,
        context=start.ids[:-1],
        tree=tree,
    )
    return (t for t, _ in gen), lambda: (stats.steps, list(stats.accepted))


def _last(start) -> mx.array:
    return mx.array(start.ids[-1:], dtype=mx.uint32)


def _mlx_lm(model, start, max_tokens):
    gen = generate_step(_last(start), model, max_tokens=max_tokens, prompt_cache=start.cache)
    count = [0]

    def tokens():
        for t, _ in gen:
            count[0] += 1
            yield t

    return tokens(), lambda: (count[0], [count[0]])


def _mlx_lm_draft(model, draft, start, max_tokens, draft_tokens):
    """speculative_generate_step; a target pass ends at its first non-draft token."""
    gen = speculative_generate_step(
        _last(start),
        model,
        draft,
        num_draft_tokens=draft_tokens,
        max_tokens=max_tokens,
        prompt_cache=start.cache + start.draft_cache,
    )
    hist, run = [0] * (draft_tokens + 1), [0]

    def tokens():
        for t, _, from_draft in gen:
            if from_draft:
                run[0] += 1
            else:
                hist[run[0]] += 1
                run[0] = 0
            yield t

    def counts():
        # The last pass may stop at max_tokens right after accepted drafts.
        h = list(hist)
        if run[0]:
            h[run[0]] += 1
        return sum(h), h

    return tokens(), counts


def run_one(model, heads, start, method, max_tokens, *, draft=None, draft_tokens=3) -> Run:
    """Generate ``max_tokens`` tokens after ``start`` with ``method``, timed."""
    if method == "mlx-lm-draft" and (draft is None or start.draft_cache is None):
        raise ClpError("mlx-lm-draft needs a draft model (--draft-model)")
    start.rewind()
    reset_peak_memory()
    tic = time.perf_counter()
    if method == "mlx-lm":
        gen, counts = _mlx_lm(model, start, max_tokens)
    elif method == "mlx-lm-draft":
        gen, counts = _mlx_lm_draft(model, draft, start, max_tokens, draft_tokens)
    else:
        gen, counts = _ours(model, heads, start, method, max_tokens)
    first = next(gen)
    t_first = time.perf_counter()
    out = [first, *gen]
    done = time.perf_counter()
    gen.close()  # a generator's finally (mlx-lm's stream restore) runs now, not at gc
    steps, accepted = counts()
    start.rewind()
    tps = (len(out) - 1) / (done - t_first) if done > t_first else 0.0
    return Run(out, tps, t_first - tic, steps, accepted, peak_memory())


# -- quality, after timing ----------------------------------------------------


def continuation_nll(model, prompt: list, generated: list, start: Start | None = None) -> float:
    """Sum of -log p(token) over ``generated``, each given prompt + earlier tokens.

    One teacher-forced pass of the backbone in float32: over prompt and
    output, or over the output alone after ``start`` (``prompt`` prefilled).
    """
    if not generated:
        return 0.0
    if start is None:
        ids = mx.array(list(prompt) + list(generated[:-1]), dtype=mx.uint32)
        logits = model(ids[None])[0, len(prompt) - 1 :].astype(mx.float32)
    else:
        start.rewind()
        ids = mx.array(list(prompt[-1:]) + list(generated[:-1]), dtype=mx.uint32)
        logits = model(ids[None], cache=start.cache)[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logp, mx.array(generated, dtype=mx.int32)[:, None], axis=-1)
    nll = float(-mx.sum(picked))
    if start is not None:
        start.rewind()
    return nll


def perplexity(model, prompt: list, generated: list) -> float:
    """exp(mean NLL of the generated tokens) under ``model``."""
    return math.exp(continuation_nll(model, prompt, generated) / max(len(generated), 1))


def repetition_ratio(tokens: list) -> float:
    """1 - distinct 3-grams / all 3-grams (the paper's measure)."""
    grams = [tuple(tokens[i : i + 3]) for i in range(len(tokens) - 2)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def common_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# -- the benchmark ---------------------------------------------------------------


def bench(model, heads, prompts, methods, *, max_tokens, repeats=1, draft=None, draft_tokens=3):
    """Run ``methods`` on each prompt (token id lists); return method -> figures."""
    methods = ["ar", *(m for m in dict.fromkeys(methods) if m != "ar")]
    kw = {"draft": draft, "draft_tokens": draft_tokens}
    drafting = draft if "mlx-lm-draft" in methods else None
    start = Start.prefill(model, prompts[0], drafting)
    for m in methods:  # warm-up: first-call costs stay out of the figures
        run_one(model, heads, start, m, min(WARMUP_TOKENS, max_tokens), **kw)
    runs = {m: [] for m in methods}
    nll, prefills = {}, []  # quality after each prompt's timing; lossless outputs share a pass
    for i, ids in enumerate(prompts):
        start = Start.prefill(model, ids, drafting)
        prefills.append(start.seconds)
        for _ in range(repeats):
            for m in methods:
                runs[m].append((i, run_one(model, heads, start, m, max_tokens, **kw)))
        for m in methods:
            for j, r in runs[m]:
                key = (j, tuple(r.tokens))
                if j == i and key not in nll:
                    nll[key] = continuation_nll(model, ids, r.tokens, start)
        del start
        mx.clear_cache()
    prefill_s = round(statistics.median(prefills), 4)
    return {m: {**_figures(m, runs[m], runs["ar"], nll), "prefill_s": prefill_s} for m in methods}


def _figures(method, runs, ar_runs, nll) -> dict:
    pairs = [(r, a) for (_, r), (_, a) in zip(runs, ar_runs)]
    ratios = [r.tps / a.tps if a.tps > 0 else 0.0 for r, a in pairs]
    hist = [sum(c) for c in zip(*(r.accepted for _, r in runs))]
    n_tokens = sum(len(r.tokens) for _, r in runs)
    total_nll = sum(nll[(i, tuple(r.tokens))] for i, r in runs)
    return {
        "lossless": method in LOSSLESS,
        "runs": len(runs),
        "decode_tps": round(statistics.median(r.tps for _, r in runs), 3),
        "first_token_s": round(statistics.median(r.first for _, r in runs), 4),
        "speedup": round(statistics.median(ratios), 3),
        "speedup_min": round(min(ratios), 3),
        "speedup_max": round(max(ratios), 3),
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


# -- memory -------------------------------------------------------------------


def peak_memory_source() -> str:
    if hasattr(mx, "get_peak_memory") and hasattr(mx, "reset_peak_memory"):
        return "mlx.get_peak_memory: MLX memory in use, weights included, reset per run"
    return "resource max RSS: the process's peak so far, cannot be reset per run"


def reset_peak_memory() -> None:
    if hasattr(mx, "reset_peak_memory"):
        mx.reset_peak_memory()


def peak_memory() -> float:
    """Bytes: MLX's peak since the last reset, or the process's max RSS."""
    if hasattr(mx, "get_peak_memory"):
        return float(mx.get_peak_memory())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(rss if sys.platform == "darwin" else rss * 1024)  # macOS: bytes, Linux: KiB
