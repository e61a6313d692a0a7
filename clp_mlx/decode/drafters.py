"""Where drafts come from: the :class:`Drafter` interface and its implementations.

A strategy never asks which drafter it holds. Per step it

1. adds the drafter's lazy work to the pass's graph at the position that
   drafts (:meth:`Drafter.at`: CLP's scores, and drafts made in the pass);
2. after the pass, tells it the committed tokens and reads CLP's scores
   (:meth:`Drafter.observe`), from which it decides how many drafts to feed;
3. asks for the drafts: one chain, or several candidates for a token tree
   (:meth:`Drafter.candidates`, best first).

Sampling strategies draw drafts inside the pass instead, with the
distributions they were drawn from (:meth:`Drafter.draft`), or, for a
drafter that drafts after the pass, ask it for a proposal and the
distribution behind it (:meth:`Drafter.proposal`; a copy is a point mass).

Implementations: :class:`HeadsDrafter` (the MTP heads), :class:`CopyThenHeads`
(copies from the context where it has a match, :mod:`.lookup`, the heads
elsewhere) and :class:`CopyDrafter` (copies only: any model, no training);
the MTP layer's in :mod:`.mtp_drafter` and :mod:`.copies_first`. A new
drafter implements these methods; :mod:`.choose` picks one for a config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import mlx.core as mx

from .lookup import ContextDrafter, CopyOdds


@dataclass
class PassDrafts:
    """The drafter's part of a pass, at the position that drafts (lazy until read)."""

    h: mx.array | None  # (1, d) the backbone's hidden state there (None: not needed)
    scores: mx.array | None  # (k+1,) CLP's scores for accepting 0..k drafts (None: no CLP)
    branches: mx.array | None  # (width, k) drafts made inside the pass, or None
    fed: mx.array | None = None  # (n, d) hidden states at every fed token (own-cache drafters)

    def along(self, path: list[int]) -> "PassDrafts":
        """Only the fed rows of ``path`` (node indices, root first): after a
        tree, a drafter with its own cache sees the accepted path's states."""
        if self.fed is None or path == list(range(len(path))):
            return self
        return replace(self, fed=self.fed[mx.array(path)])

    def lazy(self) -> list[mx.array]:
        return [x for x in (self.h, self.scores, self.branches, self.fed) if x is not None]


class Drafter(Protocol):
    k: int  # the most drafts a proposal holds
    in_pass: bool  # drafts are made inside the pass (else after it, on demand)

    def at(self, hidden: mx.array, choices: mx.array, accepted: mx.array) -> PassDrafts:
        """Lazy work for the pass's graph. ``hidden`` (n, d): the backbone's
        hidden states at the n fed tokens; ``choices`` (n,): its token after
        each; ``accepted`` (): the fed token the accepted path ends at, where
        the next drafts start (a drafter with its own cache extends it with
        the accepted path's states)."""

    def prompt(self, hidden: mx.array, tokens: mx.array) -> None:
        """Prefill: the backbone's hidden states (n, d) at the next n prompt
        positions and the token after each (for a drafter with its own cache)."""

    def extend(self, tokens: list[int]) -> None:
        """Tokens committed to the output (without :meth:`observe`)."""

    def observe(self, committed: list[int], got: PassDrafts) -> list[float]:
        """After a pass: ``committed`` (ending with the backbone's token) were
        committed; CLP's scores for the next drafts."""

    def can_branch(self) -> bool:
        """Whether :meth:`candidates` can offer more than one candidate now."""

    def candidates(self, depth: int, count: int) -> list[list[int]]:
        """Up to ``count`` draft sequences of up to ``depth`` tokens, best first."""

    def alternatives(self) -> list[list[tuple[int, float]]]:
        """After :meth:`observe`, per draft depth j = 1, 2, ...: other tokens
        than the j-th draft that could follow the drafts before it, each with
        its chance of being the backbone's token there (given those drafts
        are); [] for none. Greedy verify feeds those that pay as leaves of a
        tree (:func:`.feed.best_tree`)."""

    def draft(self, h: mx.array, b: mx.array, sampler=None):
        """Drafts (rows, k) drawn inside the pass, and their logits (rows, k, V)
        when ``sampler`` draws them (None: greedy, logits None)."""

    def proposal(self, depth: int, sampler) -> tuple[list[int], mx.array | None]:
        """After :meth:`observe`, for sampling: up to ``depth`` drafts and the
        logits (m, V) they were drawn from; None: each is a point mass."""


class HeadsDrafter:
    """The MTP heads: drafts from the backbone's hidden state and token t+1.

    ``width``: head 1's best tokens offered as branches of a tree (1: a
    chain). ``in_pass``: draft inside the pass's graph (no extra round trip),
    or only after it, on demand (when another source may make it needless).
    """

    def __init__(self, model, heads, width: int = 1, in_pass: bool = True):
        self.model, self.heads, self.k = model, heads, heads.k
        self.width, self.in_pass = width, in_pass
        self._got, self._b = None, None

    def at(self, hidden, choices, accepted) -> PassDrafts:
        h, b = hidden[accepted][None], choices[accepted][None]
        branches = None
        if self.in_pass:
            branches = self.heads.draft_branches(self.model, h, b, self.width)
        return PassDrafts(h, self.heads.clp_logits(h[0]), branches)

    def prompt(self, hidden, tokens) -> None:
        pass  # the heads see only the hidden state and token t+1

    def extend(self, tokens) -> None:
        pass

    def observe(self, committed, got: PassDrafts) -> list[float]:
        self._got, self._b = got, committed[-1]
        return got.scores.tolist()

    def can_branch(self) -> bool:
        return self.width > 1

    def alternatives(self) -> list:
        return []  # its runners-up go in fixed-size trees (width)

    def candidates(self, depth: int, count: int) -> list[list[int]]:
        branches = self._got.branches
        if branches is None:  # drafted now, after the pass
            b = mx.array([self._b], dtype=mx.uint32)
            branches = self.heads.draft_branches(self.model, self._got.h, b, min(count, self.width))
        return [branch[:depth] for branch in branches.tolist()[:count]]

    def proposal(self, depth, sampler):
        b = mx.array([self._b], dtype=mx.uint32)
        drafts, logits = self.heads.draft(self.model, self._got.h, b, sampler)
        return drafts[0, :depth].tolist(), logits[0, :depth]

    def draft(self, h, b, sampler=None):
        # Greedy drafts go through the draft vocabulary (a slice of the output
        # projection); sampled ones need the full distribution q.
        return self.heads.draft(self.model, h, b, sampler)


class CopyThenHeads:
    """Context drafts where the context has a match, the heads elsewhere.

    The heads run only when there is no copy: after the pass, on the hidden
    state it kept, so a step that copies (most, on repetitive text) skips
    their cost. CLP gets one row of scores per match length, so it trusts
    copies and heads differently.
    """

    in_pass = False  # copies need the committed tokens: drafts come after the pass

    def __init__(self, heads: HeadsDrafter, tokens: list[int]):
        self.heads, self.k = heads, heads.k
        bundle = heads.heads
        self.copies = ContextDrafter(tokens, bundle.config.lookup)
        rows = bundle.clp_context.tolist()  # CLP's scores per match length
        # The pass's scores hold row 0 (the heads' drafts) already.
        self.rows = [[x - x0 for x, x0 in zip(row, rows[0])] for row in rows]
        self._copied = None

    def at(self, hidden, choices, accepted) -> PassDrafts:
        return self.heads.at(hidden, choices, accepted)

    def prompt(self, hidden, tokens) -> None:
        pass  # the context came with the constructor

    def extend(self, tokens) -> None:
        self.copies.extend(tokens)

    def observe(self, committed, got: PassDrafts) -> list[float]:
        scores = self.heads.observe(committed, got)
        self.copies.extend(committed)
        copied, match = self.copies.propose(self.k)
        self._copied = copied if match else None
        return [s + r for s, r in zip(scores, self.rows[match])]

    def can_branch(self) -> bool:
        return bool(self._copied) or self.heads.can_branch()

    def alternatives(self) -> list:
        return []

    def candidates(self, depth: int, count: int) -> list[list[int]]:
        if self._copied is None:
            return self.heads.candidates(depth, count)
        if count == 1:
            return [self._copied[:depth]]
        return self.copies.candidates(depth, count)

    def proposal(self, depth, sampler):
        if self._copied is None:
            return self.heads.proposal(depth, sampler)
        return self._copied[:depth], None

    def draft(self, h, b, sampler=None):
        return self.heads.draft(h, b, sampler)


class CopyDrafter:
    """Context drafts only, for a model with no trained drafter (prompt lookup decoding).

    Nothing runs in the pass. Where the context has no match the step feeds
    the backbone's token alone, a plain step; where it has one, the odds
    learnt so far (:class:`.lookup.CopyOdds`) and the pass costs decide how
    many copied tokens to feed.
    """

    in_pass = False

    def __init__(self, k: int, tokens: list[int], max_ngram: int = 3):
        self.k = k
        self.copies = ContextDrafter(tokens, max_ngram)
        self.odds = CopyOdds(k, max_ngram)
        self._copied, self._match, self._fed = [], 0, 0

    def at(self, hidden, choices, accepted) -> PassDrafts:
        return PassDrafts(None, None, None)

    def prompt(self, hidden, tokens) -> None:
        pass

    def extend(self, tokens) -> None:
        self.copies.extend(tokens)

    def observe(self, committed, got) -> list[float]:
        self.odds.learn(self._match, self._fed, len(committed) - 1)
        self.copies.extend(committed)
        self._copied, self._match = self.copies.propose(self.k)
        self._fed = 0
        return self.odds.scores(self._match)

    @property
    def matched(self) -> bool:
        """Whether the context matched at the last :meth:`observe`."""
        return self._match > 0

    @property
    def match(self) -> int:
        """How many tokens the context matched at the last :meth:`observe` (0: none)."""
        return self._match

    def can_branch(self) -> bool:
        return self.matched

    def alternatives(self) -> list:
        return []

    def candidates(self, depth: int, count: int) -> list[list[int]]:
        found = [self._copied[:depth]] if count == 1 else self.copies.candidates(depth, count)
        found = found or [[]]
        self._fed = max(len(c) for c in found)
        return found

    def proposal(self, depth, sampler):
        return self.candidates(depth, 1)[0], None

    def draft(self, h, b, sampler=None):
        raise NotImplementedError("copies are drafted after the pass (in_pass is False)")
