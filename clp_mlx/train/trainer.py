"""Training MTP heads, then CLP, the gate and head 0, on a frozen backbone.

Heads learn from cached backbone features (see :mod:`clp_mlx.train.features`):
head i maps h_t to a hidden vector that should (a) project to the backbone's
own greedy token b_{t+i} (cross-entropy over a reduced draft vocabulary, the
most frequent backbone predictions: FR-Spec's trick, since a full-vocabulary
projection per head per token is the expensive part) and (b) be close to the
backbone's hidden state h_{t+i} (feature-level distillation, as EAGLE does).

Batches are drawn from a generator seeded by (seed, step), and the optimizer
state is checkpointed with the heads, so a resumed run takes the same steps
as an uninterrupted one.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import ClpError
from ..model import backbone
from ..model.heads import MTPBundle
from ..paths import atomic_file


@dataclass
class TrainConfig:
    k: int = 3
    design: str = "embed"
    steps: int = 1500
    batch: int = 256
    lr: float = 1e-3
    feature_weight: float = 0.1  # smooth-L1 to h_{t+i} next to the CE term
    draft_vocab: int = 16384  # reduced vocabulary for the training CE
    seed: int = 0
    checkpoint_every: int = 100  # also how often the history records loss and accuracy


class Positions:
    """Flat view of the cached features: position t and its k futures."""

    def __init__(self, tokens, hidden, greedy_ids, k, start: int = 0, rows=None):
        n, length = tokens.shape
        self.k = k
        self.rows = tokens  # (n, length): what decoding had seen at each position
        self.hidden = hidden.reshape(n * length, -1)
        self.greedy = greedy_ids.reshape(-1)
        self.tokens = tokens.reshape(-1)
        t = np.arange(start, length - 1 - k)  # positions whose k futures lie in the row
        self.per_row = t.size  # index is row-major: (rows, per_row) when reshaped
        rows = np.arange(n) if rows is None else np.asarray(rows)
        self.index = (rows[:, None] * length + t[None]).reshape(-1)

    def __len__(self):
        return self.index.size

    def batch(self, idx: np.ndarray):
        at = self.index[idx]
        ahead = at[:, None] + np.arange(1, self.k + 1)[None]
        return {
            "h": mx.array(self.hidden[at], dtype=mx.float32),
            # Token t+1 as the row has it: the backbone's own choice in a greedy
            # continuation, the text's token in teacher-forced text. The labels
            # b_{t+i} are conditioned on the row's tokens, so the heads must see
            # those, never the backbone's guess at a token the text overrode.
            "b": mx.array(self.tokens[at + 1]),
            "before": mx.array(self.tokens[ahead]),  # row tokens t+1..t+k
            "future_h": mx.array(self.hidden[ahead], dtype=mx.float32),
            "future_b": mx.array(self.greedy[ahead]),  # backbone's choice of t+1+i
        }


def draft_vocabulary(greedy_ids: np.ndarray, size: int, vocab: int, prefer=None) -> np.ndarray:
    """The ``size`` most frequent of ``greedy_ids``, sorted. Where the data
    holds fewer distinct tokens, the ids of ``prefer`` (an earlier drafter's
    vocabulary) come next, then the lowest ids; among equal counts too."""
    counts = 2 * np.bincount(greedy_ids.reshape(-1), minlength=vocab).astype(np.int64)
    if prefer is not None:
        counts[np.asarray(prefer, dtype=np.int64)] += 1
    return np.sort(np.argsort(-counts, kind="stable")[: min(size, vocab)])


class HeadTrainer:
    def __init__(self, model, bundle: MTPBundle, data: Positions, cfg: TrainConfig, vocab_ids):
        self.model, self.bundle, self.data, self.cfg = model, bundle, data, cfg
        # fp32 rows of the output projection (dequantized, if it is quantized)
        self.w_draft = backbone.output_rows(model, mx.array(vocab_ids)).astype(mx.float32)
        id_map = np.full(model.args.vocab_size, -1, dtype=np.int32)
        id_map[vocab_ids] = np.arange(len(vocab_ids))
        self.id_map = mx.array(id_map)
        bundle.freeze()
        for head in bundle.heads:
            head.unfreeze()
        if "head0" in bundle:
            bundle.head0.unfreeze()
        self.opt = optim.AdamW(
            learning_rate=optim.cosine_decay(cfg.lr, cfg.steps), weight_decay=0.0
        )
        self.step = 0
        self._grad = nn.value_and_grad(bundle, self._loss)

    def _ce(self, hidden, ids):
        mapped = self.id_map[ids]
        valid = (mapped >= 0).astype(mx.float32)
        logits = hidden @ self.w_draft.T
        ce = nn.losses.cross_entropy(logits, mx.maximum(mapped, 0), reduction="none")
        hit = (mx.argmax(logits, axis=-1) == mapped).astype(mx.float32) * valid
        return (ce * valid).sum() / mx.maximum(valid.sum(), 1), hit, valid

    def _loss(self, batch):
        bundle = self.bundle
        out = bundle.draft_hidden(batch["h"], teacher_embeddings(self.model, bundle, batch))
        ce, hit, valid = self._ce(out, batch["future_b"])
        feat = nn.losses.smooth_l1_loss(out, batch["future_h"], reduction="mean")
        loss = ce + self.cfg.feature_weight * feat
        if "head0" in bundle:
            ce0, _, _ = self._ce(bundle.head0(batch["h"]), batch["b"])  # the row's t+1
            loss = loss + ce0
        acc = hit.sum(axis=0) / mx.maximum(valid.sum(axis=0), 1)
        return loss, acc

    def batch_indices(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.cfg.seed, step])
        return rng.integers(0, len(self.data), self.cfg.batch)

    def train_step(self):
        batch = self.data.batch(self.batch_indices(self.step))
        (loss, acc), grads = self._grad(batch)
        self.opt.update(self.bundle, grads)
        mx.eval(self.bundle.parameters(), self.opt.state, loss, acc)
        self.step += 1
        return loss.item(), acc.tolist()

    # -- checkpoints ---------------------------------------------------
    def save(self, folder: Path) -> None:
        arrays = dict(tree_flatten(self.bundle.parameters(), prefix=".model"))
        arrays.update(tree_flatten(self.opt.state, prefix=".opt"))
        save_checkpoint(folder, arrays, {"step": self.step, "config": asdict(self.cfg)})

    def restore(self, folder: Path) -> bool:
        got = load_checkpoint(folder, asdict(self.cfg))
        if got is None:
            return False
        arrays, meta = got
        self.bundle.load_weights(part(arrays, "model"))
        self.opt.state = tree_unflatten(part(arrays, "opt"))
        self.step = meta["step"]
        return True


CHECKPOINT = "state.safetensors"


def save_checkpoint(folder: Path, arrays: dict, meta: dict) -> None:
    """Weights, optimizer state and ``meta`` (step, config, ...) in one file,
    replaced atomically: a kill leaves the last whole checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_file(folder / CHECKPOINT) as tmp, open(tmp, "wb") as f:
        # a file, not a name: MLX would add ".safetensors"
        mx.save_safetensors(f, arrays, metadata={"meta": json.dumps(meta)})


def load_checkpoint(folder: Path, config: dict, defaults: dict | None = None):
    """(arrays, meta) of the checkpoint in ``folder`` made with ``config``;
    None when there is none, or it is of another configuration. With
    ``defaults``, settings added since the checkpoint was made count as
    their defaults."""
    path = folder / CHECKPOINT
    if not path.is_file():
        return None
    arrays, metadata = mx.load(str(path), return_metadata=True)
    try:
        meta = json.loads(metadata.get("meta", "{}"))
    except (ValueError, RecursionError):
        meta = None
    if not isinstance(meta, dict):
        raise ClpError(f"{path}: not a checkpoint of this project; remove it, or use another --out")
    saved = meta.get("config")
    if defaults is not None and isinstance(saved, dict):
        saved = {**defaults, **saved}
    return (arrays, meta) if saved == config else None


def part(arrays: dict, prefix: str) -> list:
    """The ``prefix.``-named arrays, without the prefix."""
    n = len(prefix) + 1
    return [(k[n:], v) for k, v in arrays.items() if k.startswith(prefix + ".")]


def teacher_embeddings(model, bundle: MTPBundle, batch: dict):
    """What the heads see of the tokens before their targets, in training.

    "embed": the row's token t+1; "chain": for head i the row's token t+i.
    In a greedy continuation these are the backbone's choices, so for i > 1
    the token the previous head should have drafted (only then does its
    draft count, as verify stops at the first miss); in teacher-forced text
    they are the text's, which the labels b_{t+i} are conditioned on.
    """
    if not bundle.uses_token_embedding:
        return None
    if bundle.config.design != "chain":
        return backbone.embed(model, batch["b"])
    return backbone.embed(model, batch["before"])


def head_drafts(model, bundle: MTPBundle, data: Positions, idx: np.ndarray, batch=128):
    """Each head's greedy draft at positions ``idx``, exactly as decoding drafts."""
    out = []
    for s in range(0, idx.size, batch):
        b = data.batch(idx[s : s + batch])
        out.append(np.array(bundle.draft(model, b["h"], b["b"])[0]))
    return np.concatenate(out)


def run_lengths(correct: np.ndarray) -> np.ndarray:
    """CLP label: length of the longest all-correct prefix of heads 1..n."""
    return np.cumprod(correct, axis=1).sum(axis=1)


def walked_tokens_per_pass(runs: np.ndarray) -> float:
    """Tokens per pass of chain verify along each row of ``runs`` (rows,
    positions: the accepted run at each position). A pass at t commits the
    backbone's token and the run, so the next pass drafts from t + run + 1."""
    tokens = passes = 0
    for row in runs:
        t = 0
        while t < row.size:
            step = 1 + int(row[t])
            tokens += min(step, row.size - t)
            passes += 1
            t += step
    return tokens / max(passes, 1)


def elapsed(t0: float) -> float:
    return round(time.perf_counter() - t0, 1)
