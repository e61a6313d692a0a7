"""What a decode step returns, and the statistics computed from steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator


@dataclass(frozen=True)
class Step:
    """One backbone pass's worth of output.

    ``tokens``: committed this step, in order. ``from_draft``: for each, whether
    a drafter wrote it (checked or not, by mode). ``accepted``: how many drafts
    were committed. ``fed``: how many drafts the pass that checked them fed
    (verify; 0 elsewhere). ``logits``: the backbone's logits (lazy, one row
    per token) for the position each token was chosen at, where a pass
    computed them (ar, verify); None where drafts are committed unchecked."""

    tokens: tuple[int, ...]
    from_draft: tuple[bool, ...]
    accepted: int
    fed: int = 0
    logits: object = None  # mx.array (len(tokens), V) or None


def tokens_of(steps: Iterable[Step]) -> Iterator[tuple[int, bool]]:
    """``(token, from_draft)`` pairs, one per committed token, in order."""
    try:
        for step in steps:
            yield from zip(step.tokens, step.from_draft)
    finally:  # closed early: the steps' generator leaves its stream context now
        getattr(steps, "close", lambda: None)()


def tokens_with_logprobs(steps: Iterable[Step]) -> Iterator[tuple[int, bool, object]]:
    """``(token, from_draft, logprobs)``, as mlx-lm's generation yields them:
    the backbone's log-probabilities over the vocabulary where the step has
    logits (lazy: computed only if read), else None."""
    import mlx.core as mx

    try:
        for step in steps:
            for i, (token, drafted) in enumerate(zip(step.tokens, step.from_draft)):
                row = None if step.logits is None else step.logits[i]
                lp = None if row is None else row - mx.logsumexp(row, keepdims=True)
                yield token, drafted, lp
    finally:
        getattr(steps, "close", lambda: None)()


@dataclass
class DecodeStats:
    """What one generation did: counts over its steps."""

    mode: str
    k: int
    steps: int = 0
    tokens: int = 0
    accepted: list = field(default_factory=list)  # accepted[n]: steps that committed n drafts

    def __post_init__(self):
        self.accepted = [0] * (self.k + 1)

    def add(self, step: Step) -> "DecodeStats":
        self.steps += 1
        self.tokens += len(step.tokens)
        self.accepted[step.accepted] += 1
        return self

    def counting(self, steps: Iterable[Step]) -> Iterator[Step]:
        """The steps, each added to these statistics as it passes."""
        try:
            for step in steps:
                self.add(step)
                yield step
        finally:
            getattr(steps, "close", lambda: None)()

    @classmethod
    def of(cls, steps: Iterable[Step], mode: str, k: int) -> "DecodeStats":
        stats = cls(mode, k)
        for step in steps:
            stats.add(step)
        return stats

    @property
    def tokens_per_step(self) -> float:
        """τ: tokens committed per backbone pass."""
        return self.tokens / self.steps if self.steps else 0.0
