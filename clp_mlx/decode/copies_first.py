"""Context copies first, another drafter elsewhere: :class:`CopiesFirst`.

Where the last 1..N tokens occurred earlier in the context, what followed
them there is drafted (prompt lookup, scored by odds learnt as decoding goes:
a :class:`.drafters.CopyDrafter`); elsewhere the inner drafter's drafts are,
with its own scores. The inner drafter sees every pass, copied or not: one
with its own cache (the MTP layer) must follow every committed token. Where
a copy is drafted, the inner drafter only follows (``observe(...,
draft=False)``): its drafts would go unused, and on the 0.5B the MTP layer's
three depths cost about a tenth of a step.

Copies may run further than the inner drafter's depths (``k``): a repeat
often goes on for longer than the layer's three drafts, and the odds learnt
per match length tell the feed rule how far to trust it.

A layer with a copy head (model/pointer.py) copies short repeats better than
lookup does, having learnt which earlier position to copy from; then copies
are drafted only from matches of at least ``shortest`` tokens, and the layer
drafts elsewhere (docs/EXPERIMENTS.md, "Context copies beside a copy head").
"""

from __future__ import annotations

from .drafters import CopyDrafter


class CopiesFirst:
    in_pass = False  # copies need the committed tokens: drafts come after the pass

    def __init__(self, inner, tokens: list[int], max_ngram: int = 3, k: int = 0, shortest: int = 1):
        """``k``: copies' drafts a step at most (0: the inner drafter's ``k``);
        ``shortest``: the fewest matched tokens a copy is drafted from."""
        self.inner, self.k = inner, max(k, inner.k)
        self.copies = CopyDrafter(k or inner.k, tokens, max_ngram)
        self.shortest = max(shortest, 1)

    def at(self, hidden, choices, accepted):
        return self.inner.at(hidden, choices, accepted)

    def prompt(self, hidden, tokens) -> None:
        self.inner.prompt(hidden, tokens)

    def extend(self, tokens) -> None:
        self.copies.extend(tokens)
        self.inner.extend(tokens)

    def observe(self, committed, got) -> list[float]:
        odds = self.copies.observe(committed, got)
        if self.copying:
            self.inner.observe(committed, got, draft=False)
            return odds
        return self.inner.observe(committed, got)

    @property
    def copying(self) -> bool:
        """Whether this step drafts a copy: the last observe found a long enough match."""
        return self.copies.match >= self.shortest

    def can_branch(self) -> bool:
        return self.copying or self.inner.can_branch()

    def alternatives(self) -> list:
        return [] if self.copying else self.inner.alternatives()

    # A step asks for at most the copies' k (its draft_len); the inner drafter may have fewer.
    def candidates(self, depth: int, count: int) -> list[list[int]]:
        if self.copying:
            return self.copies.candidates(depth, count)
        return self.inner.candidates(min(depth, self.inner.k), count)

    def proposal(self, depth, sampler):
        if self.copying:
            return self.copies.proposal(depth, sampler)
        return self.inner.proposal(min(depth, self.inner.k), sampler)

    def draft(self, h, b, sampler=None):
        return self.inner.draft(h, b, sampler)
