"""How tokens are chosen: the sampler as a value, and the speculative acceptance rule.

A :class:`Sampler` is built once per generation (:func:`make_sampler`, in
mlx-lm's shape) and called by the step: ``sampler(logits)`` returns a token
per row. Greedy is argmax; otherwise the distribution follows mlx-lm's
``make_sampler`` (top-p, min-p and top-k masks from ``mlx_lm.sample_utils``
on the model's own probabilities, then the temperature). The backbone (p) and
the drafts (q) go through the same transform, so speculative sampling in
``verify`` draws from exactly the distribution plain ``ar`` sampling draws
from. Everything builds lazy MLX graphs with explicit ``mx.random`` keys:
one evaluation per step, and a seed fixes a generation.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..errors import ClpError
from ..model import checks
from ..model.checks import is_whole, real


@dataclass(frozen=True)
class Sampling:
    """Sampling settings. ``temp == 0`` is greedy (argmax), the default."""

    temp: float = 0.0
    top_p: float = 1.0  # keep the smallest set of tokens holding this much mass
    top_k: int = 0  # keep the k most likely tokens; 0 keeps them all
    seed: int | None = None  # None: drawn from mlx's global generator (mx.random.seed)
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability

    def __post_init__(self):
        if not real(self.temp, "the temperature (--temp)") >= 0:
            raise ClpError(f"the temperature must be 0 (greedy) or more, got {self.temp}")
        if not 0 < real(self.top_p, "top_p (--top-p)") <= 1:
            raise ClpError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (is_whole(self.top_k) and self.top_k >= 0):
            raise ClpError(f"top_k must be 0 (off) or more, got {self.top_k!r} (--top-k)")
        if not 0 <= real(self.min_p, "min_p") < 1:
            raise ClpError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.seed is not None:
            checks.seed(self.seed, "the seed (--seed)")

    @property
    def greedy(self) -> bool:
        return self.temp == 0


def greedy(logits: mx.array) -> mx.array:
    # argmax over log-probabilities, exactly as mlx-lm's greedy sampler sees
    # them, so that near-ties resolve the same way as in mlx_lm.generate.
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)


def check_argmax(logits: mx.array) -> mx.array:
    """The backbone's choice at each row of a verify pass.

    On fp32 logits a plain argmax: the log-softmax of :func:`greedy` costs
    ~2.4 ms per row of a 152k vocabulary on a CPU (40 ms for a 16-token
    tree), and the rows of a wide pass differ from a one-token pass's by
    matmul rounding anyway, far more than the subtraction of a row's
    constant can move a near-tie. On fp16 or bf16 logits it is not so: the
    log-probabilities rounded to 8 or 11 bits turn near-ties into ties that
    go to the lower id in ar and in mlx-lm, so verify takes :func:`greedy`.
    """
    if logits.dtype == mx.float32:
        return mx.argmax(logits, axis=-1)
    return greedy(logits)


def log_probs(logits: mx.array, s: Sampling) -> mx.array:
    """Normalised log-probabilities of the distribution tokens are drawn from.

    Rows are independent: ``logits`` may be (V,) or (rows, V). Tokens outside
    top-p / min-p / top-k get -inf; the masks are mlx-lm's, applied in its
    order, so a token is a candidate here exactly when it is in mlx-lm.
    """
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    if s.top_p < 1:
        lp = apply_top_p(lp, s.top_p)
    if s.min_p > 0:
        lp = apply_min_p(lp, s.min_p)
    if 0 < s.top_k < lp.shape[-1]:
        lp = apply_top_k(lp, s.top_k)
    scaled = lp * (1.0 / s.temp)
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def draw(logprobs: mx.array, key: mx.array) -> mx.array:
    """One token per row of ``logprobs``, each row independently."""
    return mx.random.categorical(logprobs, axis=-1, key=key).astype(mx.uint32)


class Sampler:
    """A generation's token chooser: ``sampler(logits)`` gives a token per row.

    Greedy samplers take the argmax; the others draw from :func:`log_probs`
    with a fresh key per call, split inside the lazy graph (no host call).
    """

    def __init__(self, settings: Sampling):
        self.settings = settings
        self.greedy = settings.greedy
        self._key = None if self.greedy else mx.random.key(_seed(settings.seed))

    def next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def log_probs(self, logits: mx.array) -> mx.array:
        return log_probs(logits, self.settings)

    def __call__(self, logits: mx.array) -> mx.array:
        if self.greedy:
            return greedy(logits)
        return draw(self.log_probs(logits), self.next_key())


def make_sampler(
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.0,
    xtc_special_tokens=None,
    *,
    seed: int | None = None,
) -> Sampler:
    """A :class:`Sampler` with ``mlx_lm.sample_utils.make_sampler``'s arguments
    and defaults (``top_p`` 0 or 1, ``min_p`` 0 and ``top_k`` 0 are off).
    ``verify`` keeps its distribution exact with it; XTC and a
    ``min_tokens_to_keep`` other than 1 are refused."""
    if xtc_probability or xtc_threshold or xtc_special_tokens:
        raise ClpError("XTC sampling is not supported by clp-mlx: verify could not stay exact")
    if min_tokens_to_keep != 1:
        raise ClpError(
            f"min_tokens_to_keep must be 1 (min-p keeps the likeliest token), got {min_tokens_to_keep}"
        )
    return Sampler(Sampling(temp, top_p or 1.0, top_k, seed, min_p))


def _seed(seed: int | None) -> int:
    if seed is not None:
        return seed
    # One host read per generation, so that mx.random.seed() governs
    # unseeded generations the way it governs mlx-lm's.
    return int(mx.random.randint(0, 2**31 - 1, ()).item())


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
