"""Lossless greedy decoding: drafts are checked in the very pass that feeds them.

A step, in phases:

1. **propose**: the drafter sees the committed tokens and offers drafts;
   CLP's scores and the measured pass costs decide how many to feed;
2. **build** the fed tokens: the backbone's token t+1 and the drafts, as a
   chain, or a token tree holding several candidates (:mod:`.tree`);
3. **one pass** of the backbone over them, with the drafter's own work for
   the next step in the same lazy graph (queued before tokens are handed out);
4. **check**: the accepted path is the longest one whose every token equals
   the backbone's choice at its parent; the backbone's choice after it is
   the next token, so every step commits at least one token;
5. **commit** the path's tokens and trim the rejected ones from the KV cache.

The output is token for token what plain greedy decoding writes, whatever
the drafter proposes and however many drafts are fed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx

from ..model.backbone import project
from .drafters import PassDrafts
from .feed import best_feed, best_tree, pass_costs
from .sampling import check_argmax
from .steps import Step
from .tree import Tree, keep_path, tree_hidden_states


@dataclass
class Pass:
    """A queued verify pass (lazy until read)."""

    fed: Tree
    start: int  # the cache offset its first node was written at
    choices: mx.array  # (len(fed),) the backbone's choice after each node
    accepted: mx.array  # () the deepest node of the accepted path
    drafts: PassDrafts  # the drafter's part, at the accepted node
    logits: mx.array  # (len(fed), V) the backbone's, after each node

    def queue(self) -> "Pass":
        """Start evaluating the graph; the host goes on (as mlx-lm queues its next step)."""
        mx.async_eval(self.choices, self.accepted, *self.drafts.lazy())
        return self


def check(tree: Tree, choices: mx.array) -> mx.array:
    """The acceptance rule: the deepest node whose every ancestor's choice is
    the next token on its path (the root, token t, is always accepted)."""
    tokens = mx.array(tree.tokens, dtype=choices.dtype)
    parents = mx.array([max(p, 0) for p in tree.parents])
    wrong = (tokens != choices[parents]).astype(mx.float32) * (mx.arange(len(tree)) > 0)
    on_path = (mx.array(tree.ancestors(), dtype=mx.float32) @ wrong) == 0
    # Siblings differ, so at most one node per depth is on the accepted path.
    return mx.argmax(mx.where(on_path, mx.array(tree.depths), -1))


def one_pass(model, drafter, fed: Tree, cache) -> Pass:
    """Feed ``fed`` through the backbone, check it, and let the drafter work
    at the accepted node: one lazy graph (see :meth:`Pass.queue`)."""
    start = cache[0].offset
    h = tree_hidden_states(model, fed, cache)
    logits = project(model, h)
    choices = check_argmax(logits)
    a = check(fed, choices)
    return Pass(fed, start, choices, a, drafter.at(h, choices, a), logits)


def commit(done: Pass, cache) -> tuple[list[int], list[int]]:
    """The accepted path (node indices) and the tokens it commits, the
    backbone's next token last; the other nodes leave the cache."""
    path = done.fed.path(done.accepted.item())
    choices = done.choices.tolist()
    committed = [done.fed.tokens[i] for i in path[1:]] + [choices[path[-1]]]
    keep_path(cache, done.start, path, len(done.fed))
    return path, committed


def propose(drafter, committed, got: PassDrafts, depth: int, config, costs, tree_size) -> Tree:
    """The tokens the next pass feeds: t+1 (the last committed) and drafts;
    ``tree_size`` None: the drafter's alternatives join where they pay."""
    b = committed[-1]
    scores = drafter.observe(committed, got)
    alternatives = drafter.alternatives() if tree_size is None and costs else []
    if alternatives:
        m, leaves = best_tree(softmax(scores), alternatives, costs, depth)
        chain = drafter.candidates(m, 1)[0] if m else []
        paths = [chain] + [chain[: j - 1] + [t] for j, t in leaves]
        return Tree.build(b, paths, 1 + len(chain) + len(leaves))
    m = feed_count(scores, depth, config.feed, costs)
    if tree_size and m >= 2 and drafter.can_branch():
        return Tree.build(b, drafter.candidates(depth, tree_size), tree_size)
    return Tree.chain([b] + (drafter.candidates(m, 1)[0] if m else []))


def feed_count(scores: list[float], depth: int, feed: str, costs) -> int:
    """How many of up to ``depth`` drafts to feed, from the drafter's scores
    for runs of 0..k accepted drafts (see :data:`.config.FEEDS`)."""
    if feed == "clp":
        return min(depth, max(range(len(scores)), key=scores.__getitem__))
    if feed == "cost":
        return best_feed(softmax(scores), costs, depth)
    return depth


def verify(model, drafter, first, cache, config, tree_size: int | None) -> Iterator[Step]:
    """Greedy verify, one pass per step; ``tree_size`` 0 feeds chains, None
    chains with the drafter's alternatives where they pay (:func:`propose`)."""
    costs = pass_costs(model, config.draft_len + 1) if config.feed == "cost" else None
    produced, budget = 0, config.max_tokens
    pending = one_pass(model, drafter, Tree.chain([first.item()]), cache)
    while True:
        done = pending
        path, committed = commit(done, cache)
        committed = committed[: budget - produced]
        produced += len(committed)
        if produced < budget:
            # Never draft past max_tokens: the extra positions would be wasted.
            depth = min(config.draft_len, budget - produced - 1)
            got = done.drafts.along(path)
            fed = propose(drafter, committed, got, depth, config, costs, tree_size)
            pending = one_pass(model, drafter, fed, cache).queue()
        drafted = tuple(i < len(path) - 1 for i in range(len(committed)))
        rows = done.logits[mx.array(path[: len(committed)])]
        yield Step(tuple(committed), drafted, len(committed) - 1, len(done.fed) - 1, rows)
        if produced >= budget:
            return


def softmax(scores: list) -> list:
    top = max(scores)
    e = [math.exp(s - top) for s in scores]
    return [x / sum(e) for x in e]
