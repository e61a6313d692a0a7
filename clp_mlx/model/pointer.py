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

over the draft vocabulary; copies of tokens outside it are dropped, or
(``outside``) drafted from columns of their own. On the 1.5B's layer, kept,
the head trained alone on 114k positions: t+2 45.7 -> 51.9% on WikiText-2
valid and 59.3 -> 63.7% on chat; with ``outside`` 54.5% and 65.7%
(docs/EXPERIMENTS.md, "A copy head (1.5B)").
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from mlx import nn

TINY = 1e-9  # added to a mixture before its log: a token of no chance scores ~ -20.7


def rms(x: mx.array) -> mx.array:
    x = x.astype(mx.float32)
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class Pointer(nn.Module):
    def __init__(self, d: int, rank: int, outside: bool = False):
        super().__init__()
        self.outside = outside  # columns for copies of tokens outside the draft vocabulary
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

    def usable(self, context: dict) -> mx.array:
        """The keys (..., n) it attends to: those offering a token (in the
        draft vocabulary unless :attr:`outside`)."""
        return context["has"] if self.outside else context["index"] >= 0

    def mix(self, scores: mx.array, g: mx.array, keys: mx.array, valid, context: dict):
        """Log-probabilities of the mixture, from the layer's ``scores``
        (..., A, V'): over the draft vocabulary (copies of tokens outside it
        dropped), or with :attr:`outside` (..., A, V' + n): then one column
        per key for the tokens outside it, at the first key offering each
        (-inf at the others). ``context``: :func:`copy_context` of the keys'
        tokens, each (..., n), broadcast like ``valid`` (..., A, n)."""
        index = context["index"][..., None, :]
        a, c = self.attend(g, keys, valid & self.usable(context)[..., None, :])
        at = mx.broadcast_to(mx.maximum(index, 0), a.shape).astype(mx.int32)
        mass = _scatter_add(mx.zeros(scores.shape), at, a * (index >= 0))
        probs = (1 - c[..., None]) * mx.softmax(scores.astype(mx.float32), axis=-1)
        inside = mx.log(probs + c[..., None] * mass + TINY)
        if not self.outside:
            return inside
        group = mx.broadcast_to(context["group"][..., None, :], a.shape).astype(mx.int32)
        outside = c[..., None] * _scatter_add(mx.zeros(a.shape), group, a)
        first = valid & context["outside"][..., None, :]
        return mx.concatenate([inside, mx.where(first, mx.log(outside + TINY), -mx.inf)], -1)


def copy_context(tokens: np.ndarray, id_map: np.ndarray) -> dict:
    """What :meth:`Pointer.mix` needs of the tokens the keys offer
    (``tokens`` (..., n), -1: none): whether each key has one, its
    draft-vocabulary index (-1: none, or outside it), the first key with
    the same token (``group``), and whether the key is that first one for a
    token outside the vocabulary (``outside``)."""
    tokens = np.asarray(tokens)
    flat = tokens.reshape(-1, tokens.shape[-1])
    group = np.empty_like(flat)
    for r, row in enumerate(flat):
        _, first, inverse = np.unique(row, return_index=True, return_inverse=True)
        group[r] = first[inverse.reshape(-1)]
    group = group.reshape(tokens.shape)
    index = np.where(tokens >= 0, id_map[np.maximum(tokens, 0)], -1)
    outside = (group == np.arange(tokens.shape[-1])) & (tokens >= 0) & (index < 0)
    arrays = {"has": tokens >= 0, "index": index, "group": group, "outside": outside}
    return {k: mx.array(v.astype(np.int32) if v.dtype != bool else v) for k, v in arrays.items()}


def _scatter_add(into: mx.array, index: mx.array, values: mx.array) -> mx.array:
    """``into`` with ``values`` added at ``index`` along the last axis (repeats add up)."""
    flat = into.reshape(-1, into.shape[-1])
    n, m = flat.shape[0], index.shape[-1]
    rows = mx.broadcast_to(mx.arange(n)[:, None], (n, m))
    return flat.at[rows, index.reshape(n, m)].add(values.reshape(n, m)).reshape(into.shape)


def id_map(draft_vocab, vocab_size: int) -> np.ndarray:
    """Token id -> draft-vocabulary index (-1: not in it); ``draft_vocab``
    None: the whole vocabulary (the index is the id)."""
    if draft_vocab is None:
        return np.arange(vocab_size)
    out = np.full(vocab_size, -1, dtype=np.int64)
    out[np.asarray(draft_vocab)] = np.arange(len(draft_vocab))
    return out


def draft_ids(draft_vocab, vocab_size: int, tokens: mx.array) -> mx.array:
    """The token id of each column of :meth:`Pointer.mix`: the draft
    vocabulary's, then the keys' ``tokens`` (..., n)."""
    ids = mx.arange(vocab_size) if draft_vocab is None else draft_vocab
    ids = mx.broadcast_to(ids.astype(mx.int32), (*tokens.shape[:-1], ids.size))
    return mx.concatenate([ids, mx.maximum(tokens, 0).astype(mx.int32)], axis=-1)
