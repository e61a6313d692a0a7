"""The benchmarked methods: our named decode configs and mlx-lm's two decoders.

Every method is timed the same way from the same start: a prompt is fed once
(all but its last token, timed: the prefill) into a cache of the backbone (with
the MTP layer's keys, as generate keeps them: :mod:`..decode.layer_cache`) and
one of the draft model, and each method decodes from those caches, rewound to
the prompt after it. The clock starts before the generator is created, the
first token marks the first pass over the prompt's last token, and decode
speed is the remaining tokens over the time they took. No method stops at
EOS: each writes exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import mlx.core as mx
from mlx_lm.generate import generate_step, speculative_generate_step

from ..decode.config import MODES, DecodeConfig
from ..decode.layer_cache import LayerCache, make_prompt_cache, split, trim_to
from ..decode.loop import decode, prefill
from ..decode.mtp_drafter import MTPDrafter
from ..decode.steps import DecodeStats, tokens_of
from ..errors import ClpError
from ..model.tokens import prompt_ids
from .measures import peak_memory, reset_peak_memory

# Our methods are named decode configs. verify: as generate runs it (feed by
# cost, context drafts, token trees where wide passes are padded); verify-all /
# verify-clp: feed every draft / what CLP expects to pass; verify-heads: no
# context drafts; verify-chain: no trees; clp-ctx: clp with context drafts (clp
# alone is the paper's: the heads' drafts).
OURS: dict[str, DecodeConfig] = {
    **{mode: DecodeConfig(mode=mode) for mode in MODES},
    "verify-all": DecodeConfig(mode="verify", feed="all"),
    "verify-clp": DecodeConfig(mode="verify", feed="clp"),
    "verify-heads": DecodeConfig(mode="verify", context_drafts=False),
    "verify-chain": DecodeConfig(mode="verify", tree=0),
    "clp-ctx": DecodeConfig(mode="clp", context_drafts=True),
}
PEERS = ("mlx-lm", "mlx-lm-draft")
METHODS = (*OURS, *PEERS)
LOSSLESS = ("ar", "verify", "verify-all", "verify-clp", "verify-heads", "verify-chain", *PEERS)
THRESHOLDED = ("clp", "clp-ctx", "prior-mtp")  # "clp@0.8": CLP's threshold rule
DEFAULT_MODES = ("ar", "verify", "clp", "fixed")
WARMUP_TOKENS = 8


def method_config(method: str) -> DecodeConfig | None:
    """The decode config a method name stands for (None: an mlx-lm peer).

    ``NAME@Q`` (clp, clp-ctx, prior-mtp) accepts the longest run whose
    probability under CLP is at least Q."""
    base, at, q = method.partition("@")
    if base not in METHODS or (at and base not in THRESHOLDED):
        raise ClpError(
            f"unknown method {method!r}; choose from {', '.join(METHODS)} "
            f"({', '.join(THRESHOLDED)} take @THRESHOLD, e.g. clp@0.8)"
        )
    if base in PEERS:
        return None
    if not at:
        return OURS[base]
    try:
        value = float(q)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise ClpError(f"{method!r}: the threshold after @ must be a number in (0, 1]")
    return replace(OURS[base], clp_threshold=value)


def needs_heads(method: str) -> bool:
    """Whether a method needs heads (verify runs on context drafts without them)."""
    config = method_config(method)
    if config is None or config.mode == "ar":
        return False
    return config.mode != "verify" or config.context_drafts is False


@dataclass
class Run:
    """One timed generation."""

    tokens: list
    tps: float  # decode tokens/s, from the first token on
    first: float  # seconds to the first token, from the prefilled prompt
    steps: int  # backbone (target model) passes
    accepted: list  # accepted[n]: passes that committed n drafts
    peak: float  # bytes, see measures.peak_memory_source()


@dataclass
class Start:
    """A prompt fed once: caches holding all but its last token."""

    ids: list
    cache: list  # the backbone's
    draft_cache: list | None  # the draft model's, for mlx-lm-draft
    seconds: float  # the backbone's prefill (the MTP layer's keys included)
    layer: LayerCache | None = None  # the MTP layer's keys, for our methods

    @classmethod
    def prefill(cls, model, ids: list, draft=None, heads=None) -> Start:
        ids, _ = prompt_ids(ids, model)  # the ids are fed here, not through decode()
        if draft is not None:
            prompt_ids(ids, draft)
        prompt = mx.array(ids, dtype=mx.uint32)
        tic = time.perf_counter()
        cache, layer = split(make_prompt_cache(model, heads))
        drafter = None if layer is None else MTPDrafter(model, heads, cache=layer)
        prefill(model, prompt, cache, drafter)  # the layer's keys of the prompt too
        seconds = time.perf_counter() - tic
        draft_cache = None
        if draft is not None:
            draft_cache = make_prompt_cache(draft)
            prefill(draft, prompt, draft_cache)
        return cls(list(ids), cache, draft_cache, seconds, layer)

    def rewind(self) -> None:
        """Drop what a method added after the prompt."""
        for c in (self.cache, self.draft_cache, None if self.layer is None else [self.layer]):
            if c is not None:
                trim_to(c, len(self.ids) - 1)


def _ours(model, heads, start, method, max_tokens):
    config = replace(method_config(method), max_tokens=max_tokens).resolve(model, heads)
    stats = DecodeStats(config.mode, config.draft_len or 0)
    caches = start.cache + ([] if start.layer is None else [start.layer])
    ids = start.ids
    steps = decode(ids[-1:], model, heads, config, prompt_cache=caches, context=ids[:-1])
    tokens = (t for t, _ in tokens_of(stats.counting(steps)))
    return tokens, lambda: (stats.steps, list(stats.accepted))


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
