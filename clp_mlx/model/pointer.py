"""A copy head beside the MTP layer: drafts a token the row has shown.

The layer misses most where the backbone is surest, and most of those misses
are tokens seen earlier in the row (names, numbers: docs/EXPERIMENTS.md,
"Where the 1.5B's drafts miss"). The pointer copies them, as a
pointer-generator network does (See et al., 2017): position ``m`` of the
context was fused with ``x_{m+1}`` and the token after it is ``x_{m+2}``;
a draft at anchor ``s`` (any depth) attends over the positions ``m < s``,

    a_m = softmax_m( Wq rms(g) . Wk rms(u_m) / sqrt(r) )

where ``g`` is the depth's output and ``u_m`` the layer's fused input at
``m`` (what its cache holds keys of), and drafts from the mixture

    p(w) = (1 - c) softmax(layer scores)(w) + c sum_{m: x_{m+2} = w} a_m
    c = sigmoid(Wc rms(g) + b + t max_m score_m)

over the draft vocabulary (copies of tokens outside it are dropped).
Prototyped on the 1.5B's shipped layer, frozen, the pointer trained alone on
114k positions: t+2 45.5 -> 54.8% on WikiText-2 valid, 59.3 -> 65.7% on chat
(docs/EXPERIMENTS.md, "A copy head").
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx import nn

TINY = 1e-9  # added to a mixture before its log: a token of no chance scores ~ -20.7


def rms(x: mx.array) -> mx.array:
    x = x.astype(mx.float32)
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class Pointer(nn.Module):
    def __init__(self, d: int, rank: int):
        super().__init__()
        self.q = nn.Linear(d, rank, bias=False)
        self.k = nn.Linear(d, rank, bias=False)
        self.choose = nn.Linear(d, 1)  # the copy chance's logit from the output
        self.sharpness = mx.zeros((1,))  # its weight on the best match's score

    @property
    def rank(self) -> int:
        return self.q.weight.shape[0]

    def keys(self, u: mx.array) -> mx.array:
        """Keys (..., n, r) of fused inputs ``u`` (..., n, d)."""
        return self.k(rms(u))

    def attend(self, g: mx.array, keys: mx.array, valid: mx.array):
        """Attention ``a`` (..., A, n) of outputs ``g`` (..., A, d) over
        ``keys`` (..., n, r) where ``valid`` (broadcast to (..., A, n)), and
        the copy chance ``c`` (..., A): 0 where no key is valid."""
        scores = (self.q(rms(g)) @ keys.swapaxes(-1, -2)) / math.sqrt(self.rank)
        scores = mx.where(valid, scores, -1e9)
        a = mx.softmax(scores, axis=-1, precise=True) * valid
        best = mx.max(mx.where(valid, scores, -20.0), axis=-1)
        c = mx.sigmoid(self.choose(rms(g))[..., 0] + self.sharpness * best)
        return a, c * mx.any(valid, axis=-1)

    def mix(self, scores: mx.array, g: mx.array, keys: mx.array, valid, copies: mx.array):
        """Log-probabilities (..., A, V') of the mixture, from the layer's
        ``scores`` (..., A, V') and the draft-vocabulary index of each key's
        token (``copies``, (..., n) broadcast like ``valid``; -1: none)."""
        a, c = self.attend(g, keys, valid & (copies >= 0)[..., None, :])
        index = mx.broadcast_to(mx.maximum(copies, 0)[..., None, :], a.shape).astype(mx.int32)
        mass = _scatter_add(mx.zeros(scores.shape), index, a)
        probs = (1 - c[..., None]) * mx.softmax(scores.astype(mx.float32), axis=-1)
        return mx.log(probs + c[..., None] * mass + TINY)


def _scatter_add(into: mx.array, index: mx.array, values: mx.array) -> mx.array:
    """``into`` with ``values`` added at ``index`` along the last axis (repeats add up)."""
    flat = into.reshape(-1, into.shape[-1])
    n, m = flat.shape[0], index.shape[-1]
    rows = mx.broadcast_to(mx.arange(n)[:, None], (n, m))
    return flat.at[rows, index.reshape(n, m)].add(values.reshape(n, m)).reshape(into.shape)


def vocab_index(draft_vocab, vocab_size: int) -> mx.array:
    """Token id -> draft-vocabulary index (-1: not in it); ``draft_vocab``
    None: the whole vocabulary (the index is the id)."""
    if draft_vocab is None:
        return mx.arange(vocab_size, dtype=mx.int32)
    ids = draft_vocab.astype(mx.int32)
    out = mx.full((vocab_size,), -1, dtype=mx.int32)
    return out.at[ids].add(mx.arange(ids.size, dtype=mx.int32) + 1)
