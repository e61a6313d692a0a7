"""Self-distilled rows (:mod:`.selfdistill_store`) as batches for the MTP layer.

A batch is whole rows: the backbone's hidden states (B, L, d) and tokens
(B, L + depths + 1), and per depth ``j`` (1-based) the flat (row, anchor)
indices whose target ``x_{s+j+1}`` is a greedy token of the row (at or past
the prompt, before ``row_len``) and in the draft vocabulary, with those
targets as draft-vocabulary indices. Given the backbone's greedy tokens at the
prompt's positions (its argmax one position before, which the prompt's own text
often is not), prompt positions are targets too, each of that token, while the
layer still reads the prompt's own tokens: teacher forcing on fixed text, as
EAGLE trains its heads.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import ClpError
from ..model.pointer import copy_context
from .selfdistill_store import load_shard, shard_folders


class Rows:
    """The rows of some shard folders, memory-mapped, padded to one length."""

    def __init__(self, folders: list[Path]):
        if not folders:
            raise ValueError("no shard folders")
        self.parts = [load_shard(f) for f in folders]
        self.length = max(p["tokens"].shape[1] for p in self.parts)
        self.where = [(i, r) for i, p in enumerate(self.parts) for r in range(len(p["tokens"]))]
        kept = {tuple(p["side_layers"].tolist()) if "side" in p else () for p in self.parts}
        # Earlier layers' states that every folder keeps (distill --side-layers),
        # given after the last layer's in each position's vector (:meth:`gather`).
        self.side_layers = kept.pop() if len(kept) == 1 else ()

    @classmethod
    def of(cls, dirs: list[Path], heldout: bool = False) -> Rows:
        return cls([f for d in dirs for f in shard_folders(Path(d), heldout)])

    @classmethod
    def for_model(cls, dirs: list, model_args, heldout: bool = False) -> Rows:
        """The training (or held-out) rows of distilled folders ``dirs`` made
        by a backbone of ``model_args``' shape; ClpError when they hold none
        yet or come from another backbone."""
        try:
            rows = cls.of([Path(d) for d in dirs], heldout)
        except ValueError:
            kind = "held-out" if heldout else "training"
            raise ClpError(f"{', '.join(map(str, dirs))}: no whole {kind} shard yet") from None
        for part in rows.parts:
            width = part["hidden"].shape[2]
            if width != model_args.hidden_size:
                raise ClpError(f"the data's hidden states are {width} wide; this model's are "
                               f"{model_args.hidden_size}: data of another backbone")  # fmt: skip
            if part["tokens"].size and part["tokens"].max() >= model_args.vocab_size:
                raise ClpError(f"the data holds token ids past this model's vocabulary "
                               f"({model_args.vocab_size}): data of another backbone")  # fmt: skip
        return rows

    def __len__(self) -> int:
        return len(self.where)

    def positions(self, prompts: bool = False) -> int:
        """Greedy (generated) positions; ``prompts``: every position a depth-1
        draft can target, the prompt's too (from the third on)."""
        if prompts:
            return int(sum(p["row_len"].sum() - 2 * len(p["row_len"]) for p in self.parts))
        return int(sum(p["row_len"].sum() - p["prompt_len"].sum() for p in self.parts))

    def prompt_hidden(self, i: int) -> np.ndarray:
        """Row ``i``'s last-layer states at its prompt's positions, (prompt_len, d)."""
        part, r = self.where[i]
        p = self.parts[part]
        return np.asarray(p["hidden"][r, : int(p["prompt_len"][r])], dtype=np.float32)

    def length_groups(self, size: int, seed: int) -> list[np.ndarray]:
        """Every row index once, in groups of about ``size`` rows of about the
        same length (ends, then prompt lengths; ties in a seeded order)."""
        ends = np.concatenate([p["row_len"] for p in self.parts])
        starts = np.concatenate([p["prompt_len"] for p in self.parts])
        order = np.random.default_rng(seed).permutation(len(ends))
        order = order[np.lexsort((starts[order], ends[order]))]
        return np.array_split(order, max(1, round(len(order) / size)))

    def greedy_tokens(self) -> np.ndarray:
        """Every greedy (generated) token, for choosing the draft vocabulary."""
        out = []
        for p in self.parts:
            for row, start, end in zip(p["tokens"], p["prompt_len"], p["row_len"]):
                out.append(np.asarray(row[start:end]))
        return np.concatenate(out)

    def gather(self, rows: np.ndarray, depths: int, side: bool = False):
        """Hidden (B, L, d) float32 (``side``: (B, L, d * (1 + S)) with the
        earlier layers' states after the last one's), tokens (B, L + depths + 1) with -1 as
        padding, prompt and row lengths (B,)."""
        width = self.length + depths + 1
        tokens = np.full((rows.size, width), -1, dtype=np.int64)
        hidden, starts, ends = [], [], []
        extra = len(self.side_layers) if side else 0
        for b, i in enumerate(rows):
            part, r = self.where[i]
            p = self.parts[part]
            n = int(p["row_len"][r])
            tokens[b, :n] = p["tokens"][r, :n]
            d = p["hidden"].shape[2]
            h = np.zeros((self.length, d * (1 + extra)), dtype=np.float32)
            h[:n, :d] = p["hidden"][r, :n]
            if extra:
                h[:n, d:] = p["side"][r, :n].reshape(n, -1)
            hidden.append(h)
            starts.append(int(p["prompt_len"][r]))
            ends.append(n)
        return np.stack(hidden), tokens, np.array(starts), np.array(ends)


def batch(rows: Rows, idx: np.ndarray, depths: int, id_map: np.ndarray, side=False,
          prompt_greedy=None, copies="") -> dict:  # fmt: skip
    """A training batch of rows ``idx`` (see the module's docstring), cut to
    the longest row, with the first anchor that has a target at some depth
    (``first``; the indices count anchors from it). ``prompt_greedy``: a
    function of a row index giving the backbone's greedy token at each of its
    prompt's positions (index ``p``: the token it chose after position ``p - 1``;
    index 0 unused); with it, those are targets too. ``copies`` ("inside"
    or "outside"): for a copy head, what its keys offer
    (:func:`.pointer.copy_context`); "outside": targets outside the draft
    vocabulary that an earlier position offers are targets too, each the
    column of its first such position (V' + m)."""
    hidden, tokens, starts, ends = rows.gather(idx, depths, side)
    targets = tokens
    if prompt_greedy is not None:
        targets = tokens.copy()
        for b, i in enumerate(idx):
            targets[b, 1 : starts[b]] = prompt_greedy(int(i))[1 : starts[b]]
        starts = np.minimum(starts, 1)
    length = int(ends.max())
    first = min(max(0, int(starts.min()) - depths - 1), length - 1)
    hidden, tokens = hidden[:, :length], tokens[:, : length + depths + 1]
    targets = targets[:, : length + depths + 1]
    s = np.arange(first, length)[None]
    out = {"h": mx.array(hidden), "tokens": mx.array(np.maximum(tokens, 0)), "first": first}
    if copies:  # what each position m offers a copy head: x_{m+2} (-1: past the row)
        after = np.arange(length)[None] + 2
        ahead = np.take_along_axis(tokens, np.minimum(after, tokens.shape[1] - 1), 1)
        offered = np.where(after < ends[:, None], ahead, -1)
        out["context"] = copy_context(offered, id_map)
        out["offered"] = mx.array(offered.astype(np.int32))
    if copies == "outside":  # the first position offering each token, per row
        first_offer = [{t: m for m, t in reversed(list(enumerate(row)))} for row in offered]
    size = int(id_map.max()) + 1  # the draft vocabulary's
    for j in range(1, depths + 1):
        target_at = s + j + 1
        greedy = (target_at >= starts[:, None]) & (target_at < ends[:, None])
        target = np.take_along_axis(targets, np.minimum(target_at, targets.shape[1] - 1), 1)
        label = id_map[np.maximum(target, 0)]
        if copies == "outside":  # outside the vocabulary: the first key offering it
            for b, a in zip(*np.nonzero(label < 0)):
                m = first_offer[b].get(int(target[b, a]), length)
                label[b, a] = size + m if m < s[0, a] else -1
        flat = np.flatnonzero(greedy & (label >= 0))
        out[f"at{j}"] = mx.array(flat.astype(np.int32))
        out[f"y{j}"] = mx.array(label.reshape(-1)[flat].astype(np.int32))
        out[f"t{j}"] = mx.array(target.reshape(-1)[flat].astype(np.int32))
        out[f"all{j}"] = int(greedy.sum())
    return out
