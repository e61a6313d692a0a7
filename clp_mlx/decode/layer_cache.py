"""The MTP layer's keys and values, carried in a prompt cache.

mlx-lm carries a draft model's cache after the target's in one list
(``prompt_cache=model_cache + draft_cache``); we carry the MTP layer's the
same way: :func:`make_prompt_cache` appends a :class:`LayerCache` to the
backbone's caches. Whatever prefills or keeps such a list (the bench's shared
prompt, a chat's earlier turns, the server's kept caches) keeps the layer's
keys for those tokens too, so the layer drafts with the whole context, as it
does when one call decodes the whole prompt.

The layer holds one position fewer than the backbone at the end of a call:
position ``i`` enters it with the token after it (``x_{i+1}``), which for the
last position is the next call's first token. :func:`resume` checks what is
kept and, where the layer lags, has the backbone re-read those few tokens.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache
from mlx_lm.models.cache import make_prompt_cache as backbone_cache


class LayerCache:
    """Keys and values (1, heads, n, dims) of the layer's committed positions,
    and the token each was fused with; a copy head's keys (n, r) of them
    too, if the layer has one. Trims as mlx-lm's caches do."""

    def __init__(self):
        self.keys = self.values = self.copy_keys = None
        self.tokens: list[int] = []  # tokens[i]: the token after position i

    @property
    def offset(self) -> int:
        return len(self.tokens)

    @property
    def past(self) -> tuple | None:
        return (self.keys, self.values) if self.tokens else None

    def add(self, keys_values: tuple, tokens: list[int], copy_keys=None) -> None:
        """The keys and values of all positions now, ``tokens`` after the new
        ones, and the copy head's keys of the new ones."""
        self.keys, self.values = keys_values
        self.tokens.extend(tokens)
        if copy_keys is not None:
            old = self.copy_keys
            self.copy_keys = copy_keys if old is None else mx.concatenate([old, copy_keys])

    def copy(self) -> LayerCache:
        other = LayerCache()
        other.add((self.keys, self.values), self.tokens, self.copy_keys)
        return other

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        keep = self.offset - n
        self.tokens = self.tokens[:keep]
        if self.keys is not None:
            self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]
        if self.copy_keys is not None:
            self.copy_keys = self.copy_keys[:keep]
        return n


def make_prompt_cache(model, heads=None) -> list:
    """The backbone's caches (mlx-lm's), and the MTP layer's after them when
    ``heads`` is an MTP layer: pass it as ``prompt_cache`` to keep both."""
    cache = backbone_cache(model)
    if heads is not None and heads.config.design == "mtp":
        cache.append(LayerCache())
    return cache


def split(prompt_cache: list) -> tuple[list, LayerCache | None]:
    """The backbone's caches and the layer's (None: not carried)."""
    layers = [c for c in prompt_cache if isinstance(c, LayerCache)]
    return [c for c in prompt_cache if not isinstance(c, LayerCache)], (layers or [None])[0]


def held(prompt_cache: list | None) -> int:
    """How many tokens ``prompt_cache`` holds: its backbone's positions."""
    return min((c.offset for c in split(prompt_cache)[0]), default=0) if prompt_cache else 0


def trim_to(prompt_cache: list, keep: int) -> None:
    """Trim every cache to its first ``keep`` positions (one by one: a pass
    stopped between two layers leaves them at different lengths)."""
    for c in prompt_cache:
        if c.offset > keep:
            c.trim(c.offset - keep)


def resume(layer: LayerCache, cache: list, ids: list[int], context: list[int]):
    """Before a call that feeds ``ids`` after the ``context`` the backbone's
    ``cache`` holds: keep the layer's positions that belong to this sequence
    and return the position the layer goes on from, the tokens to feed, and
    the cache the layer extends in this call.

    Its positions before the backbone's last are the backbone's; the one at
    the backbone's last counts only if it was fused with ``ids[0]``. Where
    the layer lags (a call stopped before it saw the last tokens' states),
    the backbone is trimmed back to it and re-reads the lagging tokens with
    the prompt: a few rows more in the prefill. Without the context's tokens
    or a trimmable cache, the layer goes on from the backbone's position in
    a copy, with a gap in its keys; the kept cache stays as it is (its
    entry ``i`` is always position ``i``)."""
    n = held(cache)
    keep = min(layer.offset, max(n - 1, 0))
    if layer.offset > n - 1 >= 0 and layer.tokens[n - 1] == ids[0]:
        keep = n
    layer.trim(layer.offset - keep)
    if keep == n:
        return n, ids, layer
    if len(context) == n and can_trim_prompt_cache(cache):
        trim_to(cache, keep)
        return keep, context[keep:] + ids, layer
    return n, ids, layer.copy()
