"""KV caches kept across requests, as mlx_lm.server keeps them: a request
whose tokens extend an earlier request's prompt and answer (the next turn of
a conversation) starts from that cache and prefills only its new tokens."""

from __future__ import annotations

from collections import OrderedDict

from mlx_lm.models.cache import make_prompt_cache


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PromptCaches:
    """At most ``size`` caches, least recently used dropped first; each is
    keyed by exactly the tokens it holds."""

    def __init__(self, model, size: int):
        self.model, self.size = model, size
        self.entries: OrderedDict[tuple, list] = OrderedDict()

    def take(self, ids: list[int]) -> tuple[list, int]:
        """A cache for ``ids`` and how many of them it already holds (at
        most all but one: the last prompt token is always fed). The cache is
        taken out of the store; :meth:`give_back` returns it."""
        best, held = None, 0
        for key in self.entries:
            n = min(common_prefix(key, ids), len(ids) - 1)
            if n > held:
                best, held = key, n
        if best is None:
            return make_prompt_cache(self.model), 0
        cache = self.entries.pop(best)
        trim(cache, held)
        return cache, held

    def give_back(self, cache: list, tokens: list[int]) -> None:
        """Keep ``cache``, which holds the first tokens of ``tokens`` (decoding
        may have run past them: the rest is trimmed)."""
        if self.size <= 0 or not cache:
            return
        keep = min(len(tokens), min(c.offset for c in cache))
        trim(cache, keep)
        self.entries[tuple(tokens[:keep])] = cache
        self.entries.move_to_end(tuple(tokens[:keep]))
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


def trim(cache: list, keep: int) -> None:
    """Trim every layer to its first ``keep`` positions."""
    for c in cache:
        if c.offset > keep:
            c.trim(c.offset - keep)
