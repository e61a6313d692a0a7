"""Sampling for the decode step: the target distribution, draws, and the
speculative acceptance rule.

Everything here builds lazy MLX graphs: a decode step samples, checks its
drafts and picks the next token without a host round trip per token. Random
numbers come from explicit ``mx.random`` keys, so a seed fixes a generation.

The distribution a token is drawn from follows mlx-lm's ``make_sampler``:
top-p and top-k choose the candidates on the model's own probabilities, then
the temperature reshapes what is left. The backbone (p) and the heads (q) go
through the same transform, so speculative sampling in ``verify`` mode draws
from exactly the distribution plain ``ar`` sampling draws from.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..errors import ClpError


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen. ``temp == 0`` is greedy (argmax), the default."""

    temp: float = 0.0
    top_p: float = 1.0  # keep the smallest set of tokens holding this much mass
    top_k: int = 0  # keep the k most likely tokens; 0 keeps them all
    seed: int | None = None  # None: drawn from mlx's global generator (mx.random.seed)

    def __post_init__(self):
        if not self.temp >= 0:
            raise ClpError(f"the temperature must be 0 (greedy) or more, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise ClpError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ClpError(f"top_k must be 0 (off) or more, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def key(self) -> mx.array:
        """The first key of a generation."""
        seed = self.seed
        if seed is None:
            # One host read per generation, so that mx.random.seed() governs
            # unseeded generations the way it governs mlx-lm's.
            seed = int(mx.random.randint(0, 2**31 - 1, ()).item())
        return mx.random.key(seed)


def log_probs(logits: mx.array, s: Sampling) -> mx.array:
    """Normalised log-probabilities of the distribution tokens are drawn from.

    Rows are independent: ``logits`` may be (V,) or (rows, V). Tokens outside
    top-p/top-k get -inf. Ties at the cut-off stay in (the set is defined by
    a probability threshold), which keeps the transform a pure function of
    the logits, the same for p and q.
    """
    logits = logits.astype(mx.float32)
    logits = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    keep = None
    if 0 < s.top_k < logits.shape[-1]:
        kth = mx.min(mx.topk(logits, s.top_k, axis=-1), axis=-1, keepdims=True)
        keep = logits >= kth
    if s.top_p < 1:
        probs = mx.exp(logits)
        ascending = mx.sort(probs, axis=-1)
        # Mass strictly above each candidate; those with at least top_p
        # above them are not needed to reach top_p.
        above = mx.cumsum(ascending, axis=-1, reverse=True, inclusive=False)
        dropped = mx.sum(above >= s.top_p, axis=-1, keepdims=True)
        smallest_kept = mx.take_along_axis(ascending, dropped, axis=-1)
        in_p = probs >= smallest_kept
        keep = in_p if keep is None else keep & in_p
    scaled = logits * (1.0 / s.temp)
    if keep is not None:
        scaled = mx.where(keep, scaled, -mx.inf)
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def draw(logprobs: mx.array, key: mx.array) -> mx.array:
    """One token per row of ``logprobs``, each row independently."""
    return mx.random.categorical(logprobs, axis=-1, key=key).astype(mx.uint32)


def acceptance_probability(lp: mx.array, lq: mx.array) -> mx.array:
    """min(1, p(x)/q(x)) from the log-probabilities of the drafted tokens."""
    return mx.minimum(1.0, mx.exp(lp - lq))


def residual(p: mx.array, q: mx.array) -> mx.array:
    """The normalised residual max(0, p - q), as log-probabilities (rows)."""
    r = mx.maximum(mx.exp(p) - mx.exp(q), 0.0)
    mass = mx.sum(r, axis=-1, keepdims=True)
    # p == q leaves no residual, but then the draft is always accepted and
    # the row is never drawn from; fall back to p so it stays a distribution.
    return mx.where(mass > 0, mx.log(r) - mx.log(mass), p)


def accept_drafts(
    p: mx.array, q: mx.array | None, drafts: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Speculative sampling: how many drafts to accept, and the next token.

    ``p``: (..., m+1, V) the backbone's log-probabilities at the fed
    positions (row i predicts the token after draft i; row 0 follows the last
    committed token). ``q``: (..., m, V) the log-probabilities draft i was
    drawn from. ``drafts``: (..., m). Leading dimensions are a batch.

    Draft i is accepted with probability min(1, p_i(x)/q_i(x)), in order; at
    the first rejection the token is drawn from the normalised residual
    max(0, p_i - q_i), and if all m are accepted, from p_m. Whatever q is,
    the accepted drafts plus that token are distributed as drawing from p one
    token at a time (Leviathan et al. 2023; Chen et al. 2023).

    Returns ``(a, token)``, each of the batch shape, a in 0..m.
    """
    m = drafts.shape[-1]
    k_accept, k_token = mx.random.split(key)
    if m == 0:
        return mx.zeros(drafts.shape[:-1], mx.uint32), draw(p[..., 0, :], k_token)
    idx = drafts[..., None].astype(mx.int32)
    lp = mx.take_along_axis(p[..., :m, :], idx, axis=-1)[..., 0]
    lq = mx.take_along_axis(q, idx, axis=-1)[..., 0]
    u = mx.random.uniform(shape=lp.shape, key=k_accept)
    ok = u < acceptance_probability(lp, lq)
    a = mx.sum(mx.cumprod(ok.astype(mx.uint32), axis=-1), axis=-1)  # longest accepted prefix
    rows = mx.concatenate([residual(p[..., :m, :], q), p[..., m:, :]], axis=-2)
    row = mx.take_along_axis(rows, a[..., None, None].astype(mx.int32), axis=-2)[..., 0, :]
    return a, draw(row, k_token)
