"""Context drafts: copy what followed the last earlier occurrence of the
context's final n tokens (prompt lookup decoding, Saxena 2023).

Greedy decoding repeats itself and its prompt: names, phrases, whole lines.
On greedy continuations of WikiText-2 valid prompts the copied token equals
the backbone's next choice far more often than a head's draft does (see the
README), so drafts come from here when the context has a match and from
the heads otherwise. CLP is told which (the match length), so it can trust
the two sources differently. With no trained drafter, copies are the only
drafts, and :class:`CopyOdds` learns how far they run while decoding.
"""

from __future__ import annotations

import math

import numpy as np


class ContextDrafter:
    """An n-gram index over the tokens so far (prompt + committed output).

    ``propose(k)`` looks for the longest suffix of 1..max_ngram tokens that
    occurred before; the tokens after that occurrence are the drafts, the
    pattern repeating when it runs into the end of the context (a loop of
    period p drafts its next p tokens over and over). ``candidates`` lists
    the other continuations too, for a token tree.
    """

    def __init__(self, tokens=(), max_ngram: int = 3):
        if max_ngram < 1:
            raise ValueError("max_ngram must be at least 1")
        self.tokens: list[int] = []
        # n-1 -> {ngram: [ends]}, every occurrence, the latest last
        self.ends: list[dict] = [{} for _ in range(max_ngram)]
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for tok in tokens:
            self._index_end()
            self.tokens.append(int(tok))

    def _index_end(self) -> None:
        # The n-grams ending at the current last token become searchable only
        # once a later token exists: a suffix never matches itself.
        s, end = self.tokens, len(self.tokens) - 1
        for n, table in enumerate(self.ends, start=1):
            if end - n + 1 < 0:
                break
            table.setdefault(tuple(s[end - n + 1 :]), []).append(end)

    def _copy(self, j: int, k: int) -> list[int]:
        """The k tokens after position j, a loop repeating its period."""
        period = len(self.tokens) - 1 - j
        return [self.tokens[j + 1 + i % period] for i in range(k)]

    def _matches(self):
        """(n, earlier ends, latest first) for each suffix length n that occurred before."""
        s, end = self.tokens, len(self.tokens) - 1
        for n in range(len(self.ends), 0, -1):
            if end - n + 1 >= 0:
                ends = self.ends[n - 1].get(tuple(s[end - n + 1 :]))
                if ends:
                    yield n, reversed(ends)

    def propose(self, k: int) -> tuple[list[int], int]:
        """``k`` drafts and the length of the match they come from (0: none)."""
        for n, ends in self._matches():
            return self._copy(next(ends), k), n
        return [], 0

    def candidates(self, k: int, limit: int) -> list[list[int]]:
        """Up to ``limit`` distinct continuations of ``k`` tokens, best first:
        longer matches before shorter ones, later occurrences before earlier.
        The first is :meth:`propose`'s."""
        seen, out = set(), []
        for _, ends in self._matches():
            for j in ends:
                got = self._copy(j, k)
                if tuple(got) not in seen:
                    seen.add(tuple(got))
                    out.append(got)
                    if len(out) == limit:
                        return out
        return out


# What copies are worth before any is checked: for a match of n tokens, the
# chance that the first copied draft is accepted, and that each later one is
# when those before it were. Measured on the 0.5B's greedy continuations of
# WikiText-2 train openings (384 rows, 30k of 37k positions with a match): n = 1:
# 0.38, then 0.71-0.92; n = 2: 0.69, then 0.78-0.91; n = 3: 0.93, then
# 0.95-0.98 (and as much within the first 48 tokens). Longer matches use n = 3's.
PRIOR = {1: (0.4, 0.75), 2: (0.7, 0.8), 3: (0.9, 0.95)}
PRIOR_WEIGHT = 4.0  # as many copies seen: a few copies of the text at hand outweigh it


class CopyOdds:
    """How far copies run before the backbone disagrees, learnt as decoding goes.

    With no trained CLP to ask, the odds that a copied draft is accepted are
    counted per match length n and draft depth i: the share of copies whose
    draft i was accepted among those whose drafts 1..i-1 were, starting from
    :data:`PRIOR` as :data:`PRIOR_WEIGHT` copies seen. (An even guess at every
    depth, as before, fed too few drafts: a 3-token match's copy runs on far
    more often than not.) :meth:`scores` turns them into log P(L = l), the
    run of accepted drafts, for the feed rule (:func:`.feed.best_feed`); no
    match scores certain failure, so the step feeds no drafts at all and
    costs what a plain step costs.
    """

    def __init__(self, k: int, max_ngram: int = 3):
        self.k = k
        self.tried = np.full((max_ngram + 1, k), PRIOR_WEIGHT)  # [n, i]: fed, reaching draft i+1
        rates = [PRIOR[min(n, max(PRIOR))] for n in range(1, max_ngram + 1)]
        rate = np.array([[first] + [later] * (k - 1) for first, later in rates])
        self.passed = np.concatenate([np.zeros((1, k)), PRIOR_WEIGHT * rate])  # ... accepted

    def scores(self, match: int) -> list[float]:
        """log P(L = l), l = 0..k, for a copy from a match of ``match`` tokens."""
        if not match:
            return [0.0] + [-math.inf] * self.k
        at_least = np.cumprod(self.passed[match] / self.tried[match])  # P(L >= i), i = 1..k
        exactly = np.append(1.0, at_least) - np.append(at_least, 0.0)
        return [math.log(p) if p > 0 else -math.inf for p in exactly]

    def learn(self, match: int, fed: int, accepted: int) -> None:
        """``fed`` copied drafts from a match of ``match`` tokens; the first ``accepted`` passed."""
        if match and fed:
            reached = min(fed, accepted + 1)
            self.tried[match, :reached] += 1
            self.passed[match, :accepted] += 1


def row_drafts(rows: np.ndarray, index: np.ndarray, k: int, max_ngram: int):
    """Context drafts at flat positions ``index`` of ``rows`` (n, length):
    at position t the known tokens are the row's first t + 2 (the backbone's
    token t+1 included), as in decoding. Returns drafts (len(index), k) and
    match lengths (len(index),); rows without a match draft -1."""
    length = rows.shape[1]
    drafts = np.full((index.size, k), -1, dtype=np.int64)
    match = np.zeros(index.size, dtype=np.int64)
    order = np.argsort(index, kind="stable")
    row_of, t_of = np.divmod(index[order], length)
    drafter, row, known = None, -1, 0
    for p, r, t in zip(order, row_of, t_of):
        if r != row or t + 2 < known:
            drafter, row, known = ContextDrafter(max_ngram=max_ngram), r, 0
        drafter.extend(rows[r, known : t + 2])
        known = t + 2
        got, n = drafter.propose(k)
        if n:
            drafts[p], match[p] = got, n
    return drafts, match
