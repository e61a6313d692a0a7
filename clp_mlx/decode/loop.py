"""``decode()``: prefill, pick the strategy, yield its steps.

Each strategy is a generator of :class:`.steps.Step` records, one backbone
pass per step (:mod:`.ar`, :mod:`.unchecked`, :mod:`.verify`,
:mod:`.verify_sampled`); statistics are counted from the steps
(:class:`.steps.DecodeStats`). The generator never prints; stop it by
closing it (EOS is the caller's business, as in mlx-lm).
"""

from __future__ import annotations

from typing import Iterator

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..model.backbone import hidden_states
from ..model.tokens import prompt_ids
from .ar import ar
from .choose import make_drafter
from .config import DecodeConfig
from .layer_cache import held as held_by
from .layer_cache import resume, split
from .sampling import Sampler
from .steps import Step
from .tree import supported
from .unchecked import unchecked
from .verify import verify
from .verify_sampled import verify_sampled, verify_sampled_after

PREFILL_STEP = 2048  # as mlx-lm: long prompts are fed in chunks to bound memory

_stream = mx.new_thread_local_stream(mx.default_device())  # as mlx-lm: usable from any thread


def prefill(model, prompt: mx.array, cache, drafter=None) -> mx.array:
    """Feed all but the last prompt token; return what is left to feed.
    ``drafter`` sees each chunk's hidden states (:meth:`.drafters.Drafter.prompt`)."""
    while prompt.size > 1:
        n = min(PREFILL_STEP, prompt.size - 1)
        h = hidden_states(model, prompt[:n], cache)
        if drafter is not None:
            drafter.prompt(h, prompt[1 : n + 1])
        mx.eval([c.state for c in cache])
        prompt = prompt[n:]
        mx.clear_cache()
    return prompt


def tree_shape(config: DecodeConfig, heads, cache) -> tuple[int, int]:
    """(tree size, head 1's branches in it) for greedy verify; (0, 1): chains;
    (None, 1): chains and the drafter's alternatives where they pay. Trees
    need a cache whose rows can be moved."""
    if config.tree == 0 or not supported(cache):
        return 0, 1
    size = config.tree
    if size is None or heads is None:
        return size, 1
    return size, max(1, min(heads.config.tree_branches, (size - 1) // config.draft_len))


def decode(
    prompt,
    model,
    heads=None,
    config: DecodeConfig | None = None,
    *,
    prompt_cache: list | None = None,
    context: list | None = None,
) -> Iterator[Step]:
    """Yield a :class:`.steps.Step` per backbone pass.

    ``heads``: the trained MTP bundle (None: context drafts only). ``config``
    is resolved here (:meth:`DecodeConfig.resolve`). ``prompt_cache``: the
    backbone's caches, and the MTP layer's after them if it is to be kept
    (:func:`.layer_cache.make_prompt_cache`). ``context``: the tokens
    ``prompt_cache`` already holds before ``prompt``, for context drafts to
    copy from (a conversation); they are not fed again. Both are checked
    first (:func:`clp_mlx.model.tokens.prompt_ids`: ids the model has, a
    prompt that fits its context), a ClpError on the first ``next()``.

    The step after the one being yielded is already queued, so when the
    caller stops, ``prompt_cache`` may hold tokens beyond those it received:
    its first ``n`` positions hold the first ``n`` tokens of prompt + output
    (the layer's, at most ``n``), and a caller that keeps the cache trims it
    to the tokens it keeps (:func:`.layer_cache.trim_to`).
    """
    held = held_by(prompt_cache)
    ids, context = prompt_ids(prompt, model, held, context)
    config = (config or DecodeConfig()).resolve(model, heads)
    cache, layer = split(prompt_cache if prompt_cache is not None else make_prompt_cache(model))
    sampler = Sampler(config.sampling)
    size, width = tree_shape(config, heads, cache) if config.mode == "verify" else (0, 1)
    known = context + ids if config.context_drafts else []
    start, feed = held, ids  # where the layer goes on from, and the tokens to feed
    mtp = config.mode != "ar" and heads is not None and heads.config.design == "mtp"
    if mtp and layer is not None:
        start, feed, layer = resume(layer, cache, ids, context)
    leaves = size is None and config.feed == "cost"  # the feed rule sizes them
    drafter = make_drafter(model, heads, config, known, width, start, layer, leaves)
    prompt = mx.array(feed, dtype=mx.uint32)

    with mx.stream(_stream):
        first = prefill(model, prompt, cache, drafter)
        if config.mode == "ar":
            yield from ar(model, first, cache, config.max_tokens, sampler)
        elif config.mode == "verify" and sampler.greedy:
            yield from verify(model, drafter, first, cache, config, size)
        elif config.mode == "verify" and drafter.in_pass:
            yield from verify_sampled(model, drafter, first, cache, config, sampler)
        elif config.mode == "verify":
            yield from verify_sampled_after(model, drafter, first, cache, config, sampler)
        else:
            yield from unchecked(model, heads, drafter, first, cache, config, sampler)
