"""KV caches kept across requests, as mlx_lm.server keeps them: a request
whose tokens extend an earlier request's prompt and answer (the next turn of
a conversation) starts from that cache and prefills only its new tokens."""

from __future__ import annotations

from collections import OrderedDict

from ..decode.layer_cache import held, make_prompt_cache, trim_to


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

    def __init__(self, model, size: int, heads=None):
        self.model, self.size = model, size
        self.heads = heads  # an MTP layer's keys are kept with the backbone's
        self.entries: OrderedDict[tuple, list] = OrderedDict()

    def take(self, ids: list[int]) -> tuple[list, int]:
        """A cache for ``ids`` and how many of them it already holds (at
        most all but one: the last prompt token is always fed). The cache is
        taken out of the store; :meth:`give_back` returns it."""
        best, n_held = None, 0
        for key in self.entries:
            n = min(common_prefix(key, ids), len(ids) - 1)
            if n > n_held:
                best, n_held = key, n
        if best is None:
            return make_prompt_cache(self.model, self.heads), 0
        cache = self.entries.pop(best)
        trim_to(cache, n_held)
        return cache, n_held

    def give_back(self, cache: list, tokens: list[int]) -> None:
        """Keep ``cache``, which holds the first tokens of ``tokens`` (decoding
        may have run past them: the rest is trimmed)."""
        if self.size <= 0 or not cache:
            return
        keep = min(len(tokens), held(cache))
        trim_to(cache, keep)
        self.entries[tuple(tokens[:keep])] = cache
        self.entries.move_to_end(tuple(tokens[:keep]))
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
