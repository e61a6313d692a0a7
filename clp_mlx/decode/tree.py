"""Token trees: several draft continuations checked in one backbone pass.

On OpenBLAS a pass over 3-15 tokens is computed as 16 rows (:mod:`clp_mlx.padrows`),
so a verify pass that feeds 2 or more drafts costs what a pass over 16 tokens
costs: the other rows are free. A tree fills them with alternatives (as
Medusa's and EAGLE's tree attention do): the other continuations the context
offers, and the heads' runners-up for t+2, each continued by the later heads.
Shared prefixes are merged, so the tree is a trie rooted at the token t the
step must feed anyway. Where rows are not padded (the few-row kernel), a pass
costs by its width, and the feed rule picks the nodes that pay
(:func:`.feed.best_tree`): the MTP layer's chain and runners-up as leaves.

Every node sees the KV cache and its own ancestors only (an attention mask)
and sits at position ``offset + depth`` (RoPE), so the backbone's prediction
at a node is exactly what it would be after the node's path alone. The
accepted path is the longest one whose every token equals the backbone's
choice at its parent; its cache rows are moved to the front and the rest
trimmed. The output is plain greedy decoding's, as with a chain.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, trim_prompt_cache

from ..model.backbone import hidden_states


@dataclass
class Tree:
    """Nodes in insertion order: the root first, every parent before its children."""

    tokens: list[int]
    parents: list[int]  # -1 for the root
    depths: list[int]

    @classmethod
    def build(cls, root: int, candidates, size: int) -> "Tree":
        """A trie of ``candidates`` (draft sequences after ``root``), inserted
        best first, of at most ``size`` nodes; a candidate that does not fit
        keeps the prefix that does."""
        tree = cls([root], [-1], [0])
        children: list[dict] = [{}]
        for seq in candidates:
            node = 0
            for tok in seq:
                nxt = children[node].get(tok)
                if nxt is None:
                    if len(tree.tokens) == size:
                        break
                    nxt = len(tree.tokens)
                    children[node][tok] = nxt
                    children.append({})
                    tree.tokens.append(tok)
                    tree.parents.append(node)
                    tree.depths.append(tree.depths[node] + 1)
                node = nxt
        return tree

    @classmethod
    def chain(cls, tokens) -> "Tree":
        """Token t and its drafts in a row: a tree without branches."""
        n = len(tokens)
        return cls(list(tokens), list(range(-1, n - 1)), list(range(n)))

    def __len__(self) -> int:
        return len(self.tokens)

    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self) - 1))

    def path(self, node: int) -> list[int]:
        """Node indices from the root to ``node``."""
        out = [node]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return out[::-1]

    def ancestors(self) -> np.ndarray:
        """(n, n) bool: [i, j] is True when j is i or one of its ancestors."""
        n = len(self)
        anc = np.eye(n, dtype=bool)
        for i in range(1, n):
            anc[i] |= anc[self.parents[i]]
        return anc


class _DepthRoPE(nn.Module):
    """The model's RoPE, but each token at ``offset + depth`` instead of
    ``offset + index``: tokens go to the batch axis, each with its own offset."""

    def __init__(self, rope: nn.Module, depths: mx.array):
        super().__init__()
        self.inner, self.depths = rope, depths

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        # (1, heads, n, dims) -> (n, heads, 1, dims) and back
        return self.inner(x.transpose(2, 1, 0, 3), offset=offset + self.depths).transpose(
            2, 1, 0, 3
        )


@contextmanager
def _depth_positions(model, depths: mx.array):
    attns = [layer.self_attn for layer in model.model.layers]
    ropes = [attn.rope for attn in attns]
    try:
        for attn, rope in zip(attns, ropes):
            attn.rope = _DepthRoPE(rope, depths)
        yield
    finally:
        for attn, rope in zip(attns, ropes):
            attn.rope = rope


def supported(cache) -> bool:
    """Trees need a cache whose rows can be moved: mlx-lm's plain KVCache."""
    return all(type(c) is KVCache for c in cache)


def tree_hidden_states(model, tree: Tree, cache) -> mx.array:
    """Final hidden states (len(tree), d) of the tree's nodes, each seeing the
    cache and its own ancestors; all nodes are appended to the cache."""
    tokens = mx.array(tree.tokens, dtype=mx.uint32)
    if tree.is_chain():
        return hidden_states(model, tokens, cache)
    start = cache[0].offset
    mask = np.concatenate([np.ones((len(tree), start), dtype=bool), tree.ancestors()], axis=1)
    h = model.model.embed_tokens(tokens[None])
    with _depth_positions(model, mx.array(tree.depths, dtype=mx.int32)):
        for layer, c in zip(model.model.layers, cache):
            h = layer(h, mx.array(mask), c)
    return model.model.norm(h)[0]


def keep_path(cache, start: int, path: list[int], fed: int) -> None:
    """Keep the cache rows of ``path`` (node indices) of the ``fed`` rows
    written from ``start``: moved to the front, the rest trimmed."""
    if path != list(range(len(path))):
        rows = mx.array([start + i for i in path])
        end = start + len(path)
        for c in cache:
            c.keys[..., start:end, :] = mx.take(c.keys, rows, axis=2)
            c.values[..., start:end, :] = mx.take(c.values, rows, axis=2)
    trim_prompt_cache(cache, fed - len(path))
