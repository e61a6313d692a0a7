"""Context copies first, another drafter elsewhere: :class:`CopiesFirst`.

Where the last 1..N tokens occurred earlier in the context, what followed
them there is drafted (prompt lookup); elsewhere the inner drafter's drafts
are. Copies are scored as :class:`.drafters.CopyDrafter` scores them, by odds
learnt as decoding goes; the inner drafter keeps its own scores. The inner
drafter sees every pass, copied or not: one with its own cache (the MTP
layer) must follow every committed token.
"""

from __future__ import annotations

from .lookup import ContextDrafter, CopyOdds


class CopiesFirst:
    in_pass = False  # copies need the committed tokens: drafts come after the pass

    def __init__(self, inner, tokens: list[int], max_ngram: int = 3):
        self.inner, self.k = inner, inner.k
        self.copies = ContextDrafter(tokens, max_ngram)
        self.odds = CopyOdds(self.k, max_ngram)
        self._copied, self._match, self._fed = [], 0, 0

    def at(self, hidden, choices, accepted):
        return self.inner.at(hidden, choices, accepted)

    def prompt(self, hidden, tokens) -> None:
        self.inner.prompt(hidden, tokens)

    def extend(self, tokens) -> None:
        self.copies.extend(tokens)
        self.inner.extend(tokens)

    def observe(self, committed, got) -> list[float]:
        self.odds.learn(self._match, self._fed, len(committed) - 1)
        scores = self.inner.observe(committed, got)
        self.copies.extend(committed)
        self._copied, self._match = self.copies.propose(self.k)
        self._fed = 0
        return self.odds.scores(self._match) if self._match else scores

    def can_branch(self) -> bool:
        return self._match > 0 or self.inner.can_branch()

    def candidates(self, depth: int, count: int) -> list[list[int]]:
        if not self._match:
            return self.inner.candidates(depth, count)
        found = [self._copied[:depth]] if count == 1 else self.copies.candidates(depth, count)
        found = found or [[]]
        self._fed = max(len(c) for c in found)
        return found

    def proposal(self, depth, sampler):
        if not self._match:
            return self.inner.proposal(depth, sampler)
        return self.candidates(depth, 1)[0], None

    def draft(self, h, b, sampler=None):
        return self.inner.draft(h, b, sampler)
