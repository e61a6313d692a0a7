"""The MTP layer as a :class:`.drafters.Drafter`: drafts with its own KV cache.

The layer's cache (:class:`.layer_cache.LayerCache`, which a prompt cache can
carry) follows the committed tokens, as the backbone's does: the
prompt's positions are added at prefill (:meth:`MTPDrafter.prompt`), and
after each pass the accepted positions, with the backbone's hidden states
there and the token committed after each. Then depth 1 at the last of them
drafts the token after the backbone's, and each further depth reads the
previous depth's output and draft one position on; these draft positions
are attention keys for the later depths only, and never enter the cache
(the next pass brings the backbone's own states for whatever it accepts).

Its scores for the feed decision are its own: the chance of a run of ``n``
accepted drafts, from each draft's probability under the layer (over the
draft vocabulary, at the depth's calibrated temperature: train/calibrate.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..model import backbone
from ..model.layer_states import watch_layers
from ..model.pointer import copy_context, draft_ids, id_map
from .drafters import PassDrafts
from .layer_cache import LayerCache

# Runners-up per depth that greedy verify may feed as leaves. Measured on a
# Linux CPU (1.5B, 15 WikiText-2 openings, the layer's steps): where the chain
# broke, the layer's second best was the backbone's token in 0.19 of its
# steps, one of its 2nd-4th best in 0.31.
RUNNERS_UP = 3


class MTPDrafter:
    in_pass = False  # drafts after the pass: it needs the accepted positions first

    def __init__(
        self, model, bundle, start=0, stop=None, cache: LayerCache | None = None, runners_up=0
    ):
        """``start``: the position the next committed entry takes; ``cache``:
        the layer's cache to extend (None: a new one); ``runners_up``: how
        many of each depth's next-best tokens to offer (:meth:`alternatives`).
        ``stop``: given P(run >= j) for the depths drafted so far (j = 0..d),
        whether the deeper drafts cannot matter (:func:`.feed.depth_rule`);
        None: always draft all ``k``."""
        self.model, self.bundle, self.layer = model, bundle, bundle.mtp
        # The backbone's earlier layers' states, if the layer reads them (train_mtp --side).
        side = self.layer.side_layers
        self.side = watch_layers(model, side) if side else None
        self.k, self.stop = bundle.k, stop
        self.cache = cache if cache is not None else LayerCache()
        self.offset = start  # the backbone position the next committed entry takes
        # Committed tokens whose positions are not in the cache yet (the
        # first one's identity is never needed: only the tokens after it).
        self.unplaced: list = [None]
        self.runners_up = runners_up
        self._drafts: list[int] = []
        self._others: list = []  # per depth drafted: (ids, chances) of the runners-up
        self.vocab = bundle.draft_vocab if "draft_vocab" in bundle else None
        self.index = None  # with a copy head: token id -> draft-vocabulary index
        if "pointer" in self.layer:
            self.index = id_map(self.vocab, model.args.vocab_size)

    def prompt(self, hidden: mx.array, tokens: mx.array) -> None:
        """Prefill: ``hidden`` (n, d) at the next n positions, ``tokens`` (n,)
        the token after each."""
        self._append(self._with_side(hidden), tokens)
        mx.eval(*self.cache.past)
        self.unplaced = [None]  # the last prompt token: the first pass feeds it

    def _append(self, hidden: mx.array, tokens: mx.array) -> mx.array:
        emb = backbone.embed(self.model, tokens.astype(mx.uint32))
        x = self.layer.fuse(hidden[None].astype(emb.dtype), emb[None])
        g, past = self.layer.step(x, self.offset, self.cache.past)
        copy_keys = self.layer.pointer.keys(x[0]) if self.index is not None else None
        self.cache.add(past, tokens.tolist(), copy_keys)
        self.offset += hidden.shape[0]
        return g[:, -1:]

    def _with_side(self, hidden: mx.array) -> mx.array:
        """``hidden`` (n, d), the rows of the pass just made, with the earlier
        layers' states of that pass after them, if the layer reads them."""
        if self.side is None or hidden.shape[-1] > self.model.args.hidden_size:
            return hidden
        side = [self.side[n][-1][0].astype(hidden.dtype) for n in self.layer.side_layers]
        return mx.concatenate([hidden, *side], axis=-1)

    def at(self, hidden, choices, accepted) -> PassDrafts:
        return PassDrafts(None, None, None, fed=self._with_side(hidden))

    def extend(self, tokens) -> None:
        self.unplaced += list(tokens)  # committed without a check (the unchecked modes)

    def observe(self, committed, got: PassDrafts, draft: bool = True) -> list[float]:
        """The pass fed the unplaced tokens first (then drafts it may have
        refused): their rows enter the cache, each with the token after it.
        ``draft=False``: only that, for a step that drafts from elsewhere
        (context copies): the depths and their projections are skipped."""
        seq = self.unplaced + list(committed)
        self.unplaced = seq[-1:]
        fed = self._with_side(got.fed)  # unchecked steps make no at(): their pass was the last
        g = self._append(fed[: len(seq) - 1], mx.array(seq[1:]))
        if not draft:
            mx.eval(*self.cache.past)
            self._drafts, self._others = [], []
            return []
        tokens, probs, self._others = self._draft(g, committed[-1])
        scores = run_scores(probs)
        mx.eval(tokens, scores, self._others, *self.cache.past)  # one evaluation for all
        self._drafts = tokens.tolist()
        return scores.tolist()

    def _draft(self, g: mx.array, last: int):
        """Greedy drafts after ``last`` through the layer's depths, the
        probability the layer gave each (over the draft vocabulary), and per
        depth its ``runners_up`` next-best tokens with their chances."""
        past, tokens, probs, prev = self.cache.past, [], [], mx.array([last])
        temps, alive, others = temperatures(self.bundle), [1.0], []
        out = self.layer.readout(self.model.model.norm, g[0])
        copy = self._copy_head()
        for depth in range(self.k):
            if depth:  # the next depth reads what the projection read
                emb = backbone.embed(self.model, prev.astype(mx.uint32))
                x = self.layer.fuse(out[None], emb[None].astype(out.dtype))
                g, past = self.layer.step(x, self.offset + depth - 1, past)
                out = self.layer.readout(self.model.model.norm, g[0])
            scores, vocab = self.bundle._draft_scores(self.model, out)
            scores, ids = (scores, vocab) if copy is None else copy(scores, g[0])
            best = mx.argmax(scores, axis=-1)
            probs.append(draft_chance(scores[0], temps[depth]))
            if self.runners_up:
                others.append(runners_up(scores[0], ids, temps[depth], self.runners_up))
            prev = best if ids is None else ids[best]
            tokens.append(prev[0])
            if self.stop is not None and depth + 1 < self.k:
                alive.append(alive[-1] * probs[-1].item())  # evaluates this depth
                if self.stop(alive):
                    break
        # Depths not drafted: chance 0, so no run reaches them.
        probs += [mx.zeros_like(probs[0])] * (self.k - len(probs))
        return mx.stack(tokens), mx.stack(probs), others

    def _copy_head(self):
        """None, or the copy head's mixture for this pass's depths: each copies
        ``x_{m+2}`` of the committed positions ``m`` before the anchor (the
        cache's last position), as training drafts (model/pointer.py)."""
        n, keys = self.cache.offset - 1, self.cache.copy_keys  # positions with a token two on
        if self.index is None or n < 1 or keys is None or keys.shape[0] != n + 1:
            return None  # (a cache another drafter filled: no keys for every position)
        keys, tokens = keys[:n], self.cache.tokens[1 : n + 1]
        context = copy_context(np.array(tokens), self.index)
        valid = mx.ones((1, n), dtype=mx.bool_)
        ids = self.vocab
        if self.layer.pointer.outside:  # its columns past the vocabulary: the keys' tokens
            ids = draft_ids(self.vocab, self.model.args.vocab_size, mx.array(tokens))
        return lambda scores, g: (self.layer.pointer.mix(scores, g, keys, valid, context), ids)

    def can_branch(self) -> bool:
        return False  # no fixed-size trees: runners-up go in by their chances (alternatives)

    def alternatives(self) -> list[list[tuple[int, float]]]:
        """Per depth drafted, the runners-up there (after the drafts before
        it) and the chance the layer gives each, as it gives its drafts."""
        out = []
        for draft, (ids, chances) in zip(self._drafts, self._others):
            pairs = zip(ids.tolist(), chances.tolist())
            out.append(sorted(((t, p) for t, p in pairs if t != draft), key=lambda x: -x[1]))
        return out

    def candidates(self, depth: int, count: int) -> list[list[int]]:
        return [self._drafts[:depth]]

    def proposal(self, depth, sampler):
        return self._drafts[:depth], None  # greedy drafts: point masses, still exact

    def draft(self, h, b, sampler=None):
        raise NotImplementedError("the MTP layer drafts after the pass (in_pass is False)")


def temperatures(bundle) -> list[float]:
    """Per depth, the temperature of the layer's chances (1.0: as trained)."""
    return bundle.config.temperatures or [1.0] * bundle.k


def draft_chance(scores: mx.array, temperature: float = 1.0) -> mx.array:
    """The chance the layer gives its draft, the best of ``scores`` (last
    axis), at ``temperature``: the same draft, a calibrated confidence."""
    s = scores.astype(mx.float32) / temperature
    return mx.exp(mx.max(s, axis=-1) - mx.logsumexp(s, axis=-1))


def runners_up(scores: mx.array, ids, temperature: float, count: int):
    """The ``count`` tokens after the best of ``scores`` (last axis, over the
    draft vocabulary; ``ids`` its token ids, None: the whole vocabulary) and
    their chances at ``temperature`` (lazy). The best is among them when tied."""
    s = scores.astype(mx.float32) / temperature
    count = min(count, s.shape[-1] - 1)  # a draft vocabulary may be tiny
    top = mx.argpartition(-s, count, axis=-1)[..., : count + 1]
    chances = mx.exp(mx.take_along_axis(s, top, axis=-1) - mx.logsumexp(s, -1, keepdims=True))
    return (top if ids is None else ids[top]), chances


def run_scores(probs: mx.array) -> mx.array:
    """Log-chances of runs of 0..k accepted drafts (last axis), taking draft
    ``j`` to be accepted with probability ``probs[..., j]`` once those before
    it are: the layer's own CLP."""
    probs = probs.astype(mx.float32)
    ones = mx.ones(probs.shape[:-1] + (1,), dtype=mx.float32)
    alive = mx.cumprod(mx.concatenate([ones, probs], axis=-1), axis=-1)  # P(run >= n)
    ends = 1.0 - mx.concatenate([probs, 0.0 * ones], axis=-1)  # the next one refused
    return mx.log(mx.maximum(alive * ends, 1e-12))
