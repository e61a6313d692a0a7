"""The decode step: one backbone pass per step, in every mode.

A step feeds the tokens not yet in the KV cache, and from the hidden states
it gets, in one lazy graph evaluated once:

- the backbone's token t+1 (always the backbone's, Backbone-as-Architect),
- k drafts for t+2..t+1+k from the heads, through the shared output projection
  (or the slice of it that the heads' draft vocabulary keeps),
- how many drafts to commit: CLP, the gate, all of them, or (verify) the
  longest prefix of the previous step's drafts that the backbone agrees with.

Modes:
    ar         plain greedy decoding, token for token what mlx-lm generates.
    clp        the paper: backbone token + the first n drafts, n from CLP, unchecked.
    fixed      backbone token + all k drafts, unchecked.
    gate       backbone token + the drafts the ~1M-parameter gate accepts.
    prior-mtp  head 0's guess replaces the backbone token (the failure mode the
               paper diagnoses), plus the drafts CLP accepts.
    verify     lossless: drafts are fed with the next pass and each is checked
               against the backbone's prediction at the position before it.
               With ``feed="clp"`` (greedy only) a step feeds just the drafts
               CLP expects to pass.

Context drafts (greedy verify, and clp when asked; heads fitted with
``lookup``): when the last tokens occurred before in prompt + output, the
drafts are copied from what followed them (:mod:`clp_mlx.lookup`) instead
of the heads', and CLP's scores get the row for that match length. The copy happens on the
host between passes, where the step's tokens are read anyway.

Sampling (``temp > 0``; ``temp == 0`` is the greedy path above, unchanged).
p is the backbone's distribution and q_i head i's, both through the same
temperature/top-p/top-k transform (:func:`clp_mlx.sampling.log_probs`):

    ar         each token drawn from p.
    verify     speculative sampling, still lossless: drafts are drawn from q,
               draft x is accepted with probability min(1, p(x)/q(x)) where p
               is the backbone's distribution at the position before it; the
               first rejected draft is replaced by a draw from the normalised
               residual max(0, p - q), and if all are accepted the next token
               is drawn from p at the last position. The tokens are
               distributed exactly as ``ar`` sampling's.
    clp, fixed, gate, prior-mtp
               as at temp 0 with argmax replaced by a draw: the backbone's
               token from p (head 0's distribution in prior-mtp), draft i
               from q_i, and CLP / the gate / all k decide how many drafts are
               committed, unchecked. These modes change the distribution
               wherever the heads are wrong, at any temperature.

Randomness comes from ``mx.random`` keys split inside the lazy graph: one
evaluation per step, a seed fixes the tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from ..model.backbone import hidden_states, project
from ..errors import ClpError
from ..native import padrows
from .feed import best_feed, pass_costs
from ..model.heads import MTPBundle, accept_count
from .lookup import ContextDrafter
from .sampling import Sampling, accept_drafts, draw, log_probs
from .tree import Tree, keep_path, supported, verify_tree_step

MODES = ("ar", "clp", "fixed", "gate", "prior-mtp", "verify")
FEEDS = ("all", "clp", "cost")  # how many drafts greedy verify feeds; see _verify
PREFILL_STEP = 2048  # as mlx-lm: long prompts are fed in chunks to bound memory

_stream = mx.new_stream(mx.default_device())


@dataclass
class DecodeStats:
    """What one generation did, step by step."""

    mode: str
    k: int
    steps: int = 0
    tokens: int = 0
    accepted: list = field(default_factory=list)  # accepted[n]: steps that committed n drafts

    def __post_init__(self):
        self.accepted = [0] * (self.k + 1)

    def record(self, n_tokens: int, n_drafts: int) -> None:
        self.steps += 1
        self.tokens += n_tokens
        self.accepted[n_drafts] += 1

    @property
    def tokens_per_step(self) -> float:
        """τ: tokens committed per backbone pass."""
        return self.tokens / self.steps if self.steps else 0.0


def greedy(logits: mx.array) -> mx.array:
    # argmax over log-probabilities, exactly as mlx-lm's greedy sampler sees
    # them, so that near-ties resolve the same way as in mlx_lm.generate.
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)


def check_argmax(logits: mx.array) -> mx.array:
    """The backbone's choice at each row of a verify pass.

    A plain argmax: the log-softmax of :func:`greedy` costs ~2.4 ms per row
    of a 152k vocabulary on a CPU (40 ms for a 16-token tree), and the rows
    of a wide pass differ from a one-token pass's by matmul rounding anyway,
    far more than the subtraction of a row's constant can move a near-tie.
    """
    return mx.argmax(logits, axis=-1)


def prefill(model, prompt: mx.array, cache) -> mx.array:
    """Feed all but the last prompt token; return what is left to feed."""
    while prompt.size > 1:
        n = min(PREFILL_STEP, prompt.size - 1)
        hidden_states(model, prompt[:n], cache)
        mx.eval([c.state for c in cache])
        prompt = prompt[n:]
        mx.clear_cache()
    return prompt


def decode(
    prompt: mx.array | list,
    model,
    heads: MTPBundle | None = None,
    *,
    mode: str = "verify",
    num_draft_tokens: int | None = None,
    max_tokens: int = 256,
    prompt_cache: list | None = None,
    stats: DecodeStats | None = None,
    gate_threshold: float = 0.5,
    sampling: Sampling | None = None,
    feed: str = "all",
    lookup: bool | None = None,
    clp_threshold: float | None = None,
    context: list | None = None,
    tree: int | None = None,
) -> Iterator[tuple[int, bool]]:
    """Yield ``(token, from_draft)`` pairs, one backbone pass per step.

    ``from_draft`` is True for tokens a head wrote (checked or not, by mode).
    ``feed`` (greedy verify): "all" feeds every draft with the next pass;
    "clp" feeds only as many as CLP predicts will be accepted, so a step that
    expects no acceptance costs a plain one-token pass. The output is the same.
    ``sampling``: None or temp 0 decodes greedily. The generator never
    prints; stop it early by closing it (EOS is the caller's business, as in
    mlx-lm).
    ``lookup``: context drafts on/off (heads fitted for them, greedy); None:
    on for verify, off for clp, where an unchecked wrong copy can send the
    backbone into a loop (1.5B on WikiText: repetition 0.24 against 0.04). ``clp_threshold`` (clp and
    prior-mtp): accept the longest n with P(run >= n) >= it, instead of
    CLP's most likely run (the paper's rule, None). ``context``: the tokens
    ``prompt_cache`` already holds before ``prompt``, for context drafts to
    copy from (a prompt cache, a conversation); they are not fed again.
    ``tree`` (greedy verify): a step that feeds 2 or more drafts feeds a
    token tree of up to this many tokens, alternatives included
    (:mod:`clp_mlx.tree`); 0 feeds a chain. None: the padded width where
    wide passes are padded (OpenBLAS, :mod:`clp_mlx.padrows`), where the
    extra rows cost nothing; else 0.

    The step after the tokens being yielded is already queued, so when the
    caller stops, ``prompt_cache`` may hold tokens beyond those it received
    (drafts, or committed tokens it did not take): its first ``n`` positions
    hold the first ``n`` tokens of prompt + output, and a caller that keeps
    the cache trims it to the tokens it keeps.
    """
    prompt = mx.array(prompt, dtype=mx.uint32) if not isinstance(prompt, mx.array) else prompt
    if prompt.ndim != 1 or prompt.size == 0:
        raise ClpError("the prompt is empty: give at least one token")
    if max_tokens < 1:
        raise ClpError(f"max_tokens must be at least 1, got {max_tokens}")
    if mode not in MODES:
        raise ClpError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if mode != "ar" and heads is None:
        raise ClpError(f"mode {mode!r} needs heads (pass --heads, or --heads init)")
    if feed not in FEEDS:
        raise ClpError(f"feed must be one of {', '.join(FEEDS)}, got {feed!r}")
    if clp_threshold is not None and not 0 < clp_threshold <= 1:
        raise ClpError(f"clp_threshold must be in (0, 1], got {clp_threshold}")
    if tree is not None and tree < 0:
        raise ClpError(f"tree must be 0 (a chain) or a number of tokens, got {tree}")
    if mode == "prior-mtp" and "head0" not in heads:
        raise ClpError("mode 'prior-mtp' needs heads with a head 0")
    k = heads.k if heads is not None and mode != "ar" else 0
    n_draft = k if num_draft_tokens is None else num_draft_tokens
    if mode != "ar" and not 1 <= n_draft <= k:
        raise ClpError(f"num_draft_tokens must be in 1..{k} for these heads, got {n_draft}")
    stats = stats if stats is not None else DecodeStats(mode, k)
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)

    greedy_path = sampling is None or sampling.greedy
    choose = greedy if greedy_path else _Sampler(sampling)
    ctx = None
    wanted = lookup if lookup is not None else mode == "verify"
    if greedy_path and mode in ("clp", "verify") and heads.config.lookup and wanted:
        ctx = _Context(heads, list(context or []) + prompt.tolist())

    with mx.stream(_stream):
        last = prefill(model, prompt, cache)
        if mode == "ar":
            yield from _ar(model, last, cache, max_tokens, stats, choose)
        elif mode == "verify" and greedy_path:
            if tree is None:
                tree = padrows.ROWS if padrows.is_padded(model) else 0
            yield from _verify(
                model, heads, last, cache, max_tokens, n_draft, stats, feed, ctx, tree
            )
        elif mode == "verify":
            yield from _verify_sampled(
                model, heads, last, cache, max_tokens, n_draft, stats, choose
            )
        else:
            yield from _unchecked(
                model,
                heads,
                last,
                cache,
                max_tokens,
                n_draft,
                mode,
                (gate_threshold, clp_threshold),
                stats,
                choose,
                ctx,
            )


class _Sampler:
    """Draws a token per row of logits, with a fresh key each call."""

    def __init__(self, sampling: Sampling):
        self.sampling = sampling
        self._key = sampling.key()

    def next_key(self) -> mx.array:
        # Lazy: the split is part of the step's graph, not a host call.
        self._key, sub = mx.random.split(self._key)
        return sub

    def log_probs(self, logits: mx.array) -> mx.array:
        return log_probs(logits, self.sampling)

    def __call__(self, logits: mx.array) -> mx.array:
        return draw(self.log_probs(logits), self.next_key())


def _ar(model, y, cache, max_tokens, stats, choose) -> Iterator[tuple[int, bool]]:
    def step(tokens):
        return choose(project(model, hidden_states(model, tokens, cache)[-1:]))

    # As mlx-lm: queue step n+1 before handing out token n, so the host work
    # of the caller overlaps the next forward pass.
    y = step(y)
    mx.async_eval(y)
    for n in range(max_tokens):
        nxt = step(y) if n + 1 < max_tokens else None
        if nxt is not None:
            mx.async_eval(nxt)
        stats.record(1, 0)
        yield y.item(), False
        y = nxt


def _draft_tokens(model, heads, h, b, choose=greedy):
    """The heads' drafts (rows, k) from hidden states ``h`` and backbone tokens ``b``.

    Greedy drafts go through the heads' draft vocabulary when they have one
    (a slice of the output projection); sampled drafts need the full
    distribution q, which verification compares with the backbone's p.
    """
    return heads.draft(model, h, b, None if choose is greedy else choose)[0]


def unchecked_step(
    model, heads, tokens, cache, mode, n_draft, thresholds=(0.5, None), choose=greedy, drafts=True
):
    """One clp / fixed / gate / prior-mtp step: [b, k drafts, n to commit],
    CLP's scores and the hidden state that drafts. ``thresholds``: the
    gate's and CLP's. ``drafts=False`` leaves the heads out, for a host
    that may copy its drafts from the context."""
    h = hidden_states(model, tokens, cache)[-1:]  # only the last position drafts
    first = heads.head0(h) if mode == "prior-mtp" else h
    b = choose(project(model, first))
    d = _draft_tokens(model, heads, h, b, choose)[0] if drafts else b[:0]
    logits = heads.clp_logits(h[0])
    if mode == "fixed":
        n = mx.array([n_draft])
    elif mode == "gate":
        n = mx.minimum(heads.gate_length(h, thresholds[0]), n_draft)
    else:  # clp, prior-mtp
        n = mx.minimum(accept_count(logits, thresholds[1]), n_draft)[None]
    return mx.concatenate([b, d, n.astype(b.dtype)]), logits, h


def _unchecked(model, heads, y, cache, max_tokens, n_draft, mode, thresholds, stats, choose, ctx):
    """clp / fixed / gate / prior-mtp: commit drafts without checking them."""

    def step(tokens):
        return unchecked_step(
            model, heads, tokens, cache, mode, n_draft, thresholds, choose, drafts=ctx is None
        )

    produced = 0
    out, logits, h = step(y)
    while True:
        host = out.tolist()
        b, drafts, n = host[0], host[1:-1], host[-1]
        if ctx is not None:
            drafts, scores = ctx.propose([b], logits)
            n = min(accept_count(mx.array(scores), thresholds[1]).item(), n_draft)
            if drafts is None:
                drafts = ctx.heads_branches(model, h, b, 1)[0] if n else []
        n = min(n, max_tokens - produced - 1)
        committed = [b] + drafts[:n]
        if ctx is not None:
            ctx.drafter.extend(drafts[:n])
        produced += len(committed)
        stats.record(len(committed), n)
        if produced < max_tokens:
            out, logits, h = step(mx.array(committed, dtype=mx.uint32))
            mx.async_eval(out, logits, h)
        yield b, mode == "prior-mtp"
        for tok in drafts[:n]:
            yield tok, True
        if produced >= max_tokens:
            return


def _softmax(scores: list) -> list:
    top = max(scores)
    e = [math.exp(s - top) for s in scores]
    return [x / sum(e) for x in e]


class _Context:
    """Context drafts for one generation, the heads' where there is no match.

    The heads run only when needed: after the pass, on the hidden state it
    kept, so a step that copies (most, on repetitive text) skips their cost.
    """

    def __init__(self, heads: MTPBundle, prompt: list):
        self.heads = heads
        self.drafter = ContextDrafter(prompt, heads.config.lookup)
        rows = heads.clp_context.tolist()  # CLP's scores per match length
        # The step's scores hold row 0 (the heads' drafts) already.
        self.rows = [[x - x0 for x, x0 in zip(row, rows[0])] for row in rows]

    def propose(self, committed: list, logits: mx.array) -> tuple[list | None, list]:
        """The copied drafts after ``committed`` (None: no match, the heads
        draft) and CLP's scores: its scores at h plus the match length's row.
        The caller decides from the scores how many drafts it needs before
        asking the heads for any."""
        self.drafter.extend(committed)
        copied, match = self.drafter.propose(self.heads.k)
        scores = [s + r for s, r in zip(logits.tolist(), self.rows[match])]
        return (copied if match else None), scores

    def candidates(self, k: int, limit: int) -> list:
        """The context's continuations of ``k`` tokens, the copy first (:mod:`clp_mlx.tree`)."""
        return self.drafter.candidates(k, limit)

    def heads_branches(self, model, h: mx.array, b: int, width: int) -> list:
        """The heads' ``width`` best branches (lists of k drafts) at ``h``."""
        got = self.heads.draft_branches(model, h, mx.array([b], dtype=mx.uint32), width)
        return got.tolist()


def _verify(model, heads, y, cache, max_tokens, n_draft, stats, feed="all", ctx=None, tree=0):
    """Lossless: check last step's drafts in the pass that feeds them.

    ``feed``: "all" feeds every draft; "clp" as many as CLP predicts will
    pass; "cost" the count with the most expected tokens per pass time
    (:mod:`clp_mlx.feed`). ``tree``: a step that feeds 2 or more drafts
    feeds a token tree of up to this many tokens instead, the alternatives
    beside the drafts (:mod:`clp_mlx.tree`). The output is the same whichever
    is chosen.
    """
    costs = pass_costs(model, n_draft + 1) if feed == "cost" else None
    tree = tree if tree and supported(cache) else 0
    # The heads' branches in a tree: 1 feeds their drafts as a chain.
    width = max(1, min(heads.config.tree_branches, (tree - 1) // n_draft)) if tree else 1

    def step(fed: Tree):
        # With context drafts the heads run after the pass, only if there is no copy.
        return verify_tree_step(model, heads, fed, cache, 0 if ctx else width, check_argmax)

    produced = 0
    fed = Tree.chain([y.item()])  # what the pending pass feeds: token t, then drafts
    start = cache[0].offset
    out, logits, h = step(fed)
    while True:
        host = out.tolist()
        path = fed.path(host[len(fed)])  # the accepted node
        b = host[path[-1]]
        committed = [fed.tokens[i] for i in path[1:]] + [b]
        committed = committed[: max_tokens - produced]
        keep_path(cache, start, path, len(fed))  # rejected drafts leave the cache
        produced += len(committed)
        stats.record(len(committed), len(committed) - 1)
        if produced < max_tokens:
            # Never draft past max_tokens: the extra positions would be wasted.
            depth = min(n_draft, max_tokens - produced - 1)
            branches = host[len(fed) + 1 : -1]
            branches = [branches[i : i + n_draft] for i in range(0, len(branches), n_draft)]
            drafts = branches[0] if branches else None
            m_next, copied = depth, None
            if ctx is not None:
                copied, scores = ctx.propose(committed, logits)
                drafts = copied or drafts
            elif feed != "all":
                scores = logits.tolist()
            if feed == "clp":
                m_next = min(m_next, max(range(len(scores)), key=scores.__getitem__))
            elif feed == "cost":
                m_next = best_feed(_softmax(scores), costs, m_next)
            as_tree = tree and m_next >= 2 and (copied or width > 1)
            if drafts is None and m_next:  # no copy: the heads draft
                branches = ctx.heads_branches(model, h, b, width if as_tree else 1)
                drafts = branches[0]
            if as_tree:
                copies = ctx.candidates(depth, tree) if ctx is not None else []
                fed = Tree.build(b, [c[:depth] for c in copies or branches], tree)
            else:
                fed = Tree.chain([b] + (drafts or [])[:m_next])
            start = cache[0].offset
            out, logits, h = step(fed)
            mx.async_eval(out, logits, h)
        for i, tok in enumerate(committed):
            yield tok, i < len(path) - 1
        if produced >= max_tokens:
            return


def _verify_sampled(model, heads, y, cache, max_tokens, n_draft, stats, sampler):
    """Lossless sampling: speculative sampling of last step's drafts.

    Same schedule as :func:`_verify`. Each step returns, besides the tokens,
    the (k, V) distributions its drafts were drawn from; they stay on the
    device and feed the next step's acceptance test.
    """

    def step(tokens, q_fed):
        h = hidden_states(model, tokens, cache)  # (m+1, d)
        p = sampler.log_probs(project(model, h))  # (m+1, V)
        a, b = accept_drafts(p, q_fed, tokens[1:], sampler.next_key())
        # Only the row after the last accepted token drafts: k projected
        # rows, not (m+1)k, and Embed heads can see the token just drawn.
        d, logits = heads.draft(model, h[a][None], b[None], sampler)
        d, q = d[0], sampler.log_probs(logits[0])  # (k,), (k, V)
        return mx.concatenate([a[None].astype(mx.uint32), b[None], d]), q

    produced = 0
    fed = [None]
    out, q = step(y, None)
    while True:
        host = out.tolist()
        m = len(fed) - 1
        a, b, drafts = host[0], host[1], host[2:]
        committed = (fed[1 : 1 + a] + [b])[: max_tokens - produced]
        trim_prompt_cache(cache, m - a)  # rejected drafts leave the cache
        produced += len(committed)
        stats.record(len(committed), len(committed) - 1)
        if produced < max_tokens:
            m_next = min(n_draft, max_tokens - produced - 1)
            fed = [b] + drafts[:m_next]
            out, q = step(mx.array(fed, dtype=mx.uint32), q[:m_next])
            mx.async_eval(out)
        for i, tok in enumerate(committed):
            yield tok, i < a
        if produced >= max_tokens:
            return
