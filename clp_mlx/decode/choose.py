"""Which drafter a resolved decode config gets: :func:`make_drafter`."""

from __future__ import annotations

from .copies_first import CopiesFirst
from .drafters import CopyDrafter, CopyThenHeads, Drafter, HeadsDrafter
from .feed import depth_rule
from .mtp_drafter import RUNNERS_UP, MTPDrafter

# Beside a copy head, context copies only from matches this long (0: the
# longest the lookup tries): the head copies shorter repeats better.
COPY_HEAD_SHORTEST = 0


def copy_shortest(heads, lookup: int) -> int:
    """The fewest matched tokens a context copy is drafted from, in the
    drafter's place: every match, or beside a copy head only the longest."""
    layer = getattr(heads, "mtp", None)
    if layer is not None and "pointer" in layer:
        return COPY_HEAD_SHORTEST or lookup
    return 1


def make_drafter(
    model, heads, config, tokens, width=1, start=0, layer=None, alternatives=False
) -> Drafter | None:
    """The drafter a resolved ``config`` asks for; ``tokens``: the context so
    far; ``start``: the position the prompt starts at (a kept cache's length);
    ``layer``: the MTP layer's kept cache (:mod:`.layer_cache`), if any;
    ``alternatives``: whether the step will ask for runners-up."""
    if config.mode == "ar":
        return None
    if heads is None:
        return CopyDrafter(config.draft_len, tokens)
    if heads.config.design == "mtp":
        runners = RUNNERS_UP if alternatives else 0
        layer = MTPDrafter(model, heads, start, depth_rule(model, config, heads.k), layer, runners)
        if not config.context_drafts:
            return layer
        lookup = heads.config.lookup
        shortest = copy_shortest(heads, lookup)
        return CopiesFirst(layer, tokens, lookup, config.draft_len, shortest)
    if config.context_drafts:
        return CopyThenHeads(HeadsDrafter(model, heads, width, in_pass=False), tokens)
    return HeadsDrafter(model, heads, width)
