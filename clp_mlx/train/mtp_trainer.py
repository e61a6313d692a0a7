"""Training the MTP layer on self-distilled rows, with the recursion unrolled.

Every depth's loss is a cross-entropy over the draft vocabulary against the
backbone's greedy token, weighted ``decay ** (j - 1)`` (FastMTP's and
EAGLE-3's depth-decayed weights); depth ``j > 1`` reads the final norm of
the layer's own output at depth ``j - 1`` ("training-time test",
:meth:`MTPLayer.unrolled`) and the greedy token before its target, which is
the token the previous depth drafted whenever its draft is accepted. Batches
come from a generator seeded by (seed, step), and the optimizer state is
checkpointed with the layer, so a resumed run takes the same steps as an
uninterrupted one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from ..model import backbone
from ..model.heads_checks import CONTEXT_NGRAM
from ..model.mtp_layer import FEED, MTPLayer
from ..model.pointer import id_map
from .mtp_data import Rows, batch
from .trainer import load_checkpoint, part, save_checkpoint


@dataclass
class MTPTrainConfig:
    depths: int = 3  # depths trained (drafts per pass at most)
    mlp_size: int = 0  # the block's MLP width (0: the backbone's)
    steps: int = 1000
    batch: int = 8  # rows a step
    lr: float = 5e-4
    warmup: int = 50
    decay: float = 0.8  # loss weight of depth j: decay ** (j - 1)
    draft_vocab: int = 16384
    seed: int = 0
    checkpoint_every: int = 25
    soft: float = 0.0  # weight of the backbone's distribution as the target (1 - soft: its token)
    feed: str = FEED  # what later depths read; checkpoints of an earlier layer are not resumed
    init_from: str = ""  # a drafter folder whose MTP layer starts the run ("": as the backbone)
    keep_vocab: bool = False  # with init_from: its draft vocabulary, not one chosen from the data
    group_by_length: bool = False  # a step's rows from one group of rows of about one length
    side: bool = False  # depth 1 also reads the earlier layers' states the data keeps
    prompt_targets: bool = False  # prompt positions train too, on the backbone's greedy tokens
    side_lr: float = 0.0  # with side: peak learning rate of the side projection (0: lr)
    pointer: int = 0  # rank of a copy head beside the layer (model/pointer.py; 0: none)
    pointer_lr: float = 0.0  # its peak learning rate (0: lr)
    pointer_only: bool = False  # train the copy head alone, the layer as it starts
    pointer_outside: bool = False  # it also copies tokens outside the draft vocabulary
    noise: float = 0.0  # training steps read states + U(-noise, noise) x each state's RMS
    passes: bool = False  # rows come in passes, each row once a pass (else drawn at random)


# Settings added since checkpoints recorded ``feed``: one without them was made
# with these values. (One without ``feed`` read another input: never resumed.)
ADDED = {"init_from": "", "keep_vocab": False, "group_by_length": False, "side": False,
         "prompt_targets": False, "side_lr": 0.0, "pointer": 0, "pointer_lr": 0.0,
         "pointer_only": False, "pointer_outside": False, "noise": 0.0, "passes": False}  # fmt: skip
GROUP_BATCHES = 16  # with group_by_length: rows a group, in batches


class MTPTrainer:
    def __init__(self, model, layer: MTPLayer, rows: Rows, cfg: MTPTrainConfig, vocab_ids):
        self.model, self.layer, self.rows, self.cfg = model, layer, rows, cfg
        self.vocab_ids = np.asarray(vocab_ids)
        self.id_map = id_map(self.vocab_ids, model.args.vocab_size)
        ids = mx.array(self.vocab_ids)
        self.w = backbone.output_rows(model, ids).astype(mx.float32)
        model.freeze()
        if cfg.pointer_only:
            layer.freeze()
            layer.pointer.unfreeze()
        own = []  # (peak rate, which parameters) of those with their own rate
        if layer.side_layers and cfg.side_lr and cfg.side_lr != cfg.lr:
            own.append((cfg.side_lr, lambda path, _: path.startswith("side_")))
        if cfg.pointer and cfg.pointer_lr and cfg.pointer_lr != cfg.lr:
            own.append((cfg.pointer_lr, lambda path, _: path.startswith("pointer.")))
        self.opt = self.optimizer(cfg.lr)
        if own:
            rest = [self.optimizer(lr) for lr, _ in own] + [self.opt]
            self.opt = optim.MultiOptimizer(rest, [which for _, which in own])
        self.step, self.history = 0, []
        self.groups, self.targets, self._pass = None, 0.0, (-1, [])
        if cfg.group_by_length:  # each depth's loss: a sum over a batch's targets / their mean
            self.groups = rows.length_groups(GROUP_BATCHES * cfg.batch, cfg.seed)
            self.targets = cfg.batch * rows.positions(cfg.prompt_targets) / len(rows)
        self._prompt_greedy: dict[int, np.ndarray] = {}
        self._grad = nn.value_and_grad(layer, self._loss)

    def optimizer(self, lr: float) -> optim.AdamW:
        """AdamW at peak rate ``lr``: linear warm-up, then cosine decay to lr / 10."""
        cfg = self.cfg
        warm = optim.linear_schedule(1e-7, lr, max(1, cfg.warmup))
        decay = optim.cosine_decay(lr, max(1, cfg.steps - cfg.warmup), lr / 10)
        return optim.AdamW(optim.join_schedules([warm, decay], [cfg.warmup]), weight_decay=0.01)

    def logits(self, g: mx.array) -> mx.array:
        """Scores over the draft vocabulary for layer outputs ``g`` (..., d)."""
        return self.layer.readout(self.model.model.norm, g) @ self.w.T

    def outputs(self, b: dict) -> list[mx.array]:
        tokens, length = b["tokens"], b["h"].shape[1]
        embed = lambda j: backbone.embed(self.model, tokens[:, j : j + length])
        norm = self.model.model.norm
        return self.layer.unrolled(b["h"], embed, self.cfg.depths, norm, first=b["first"])

    def _loss(self, b: dict):
        total, hits, soft = mx.array(0.0), [], self.cfg.soft
        width = self.model.args.hidden_size
        outs = self.outputs(b)
        keys = self._copy_keys(b) if "pointer" in self.layer else None
        for j, g in enumerate(outs, 1):
            at, y = b[f"at{j}"], b[f"y{j}"]
            if at.size == 0:  # no row of the batch reaches this depth inside its continuation
                hits.append(mx.array(0))
                continue
            g = g.reshape(-1, width)[at]
            logits, aux = self.logits(g), 0.0
            if keys is not None:
                logits, aux = self._with_copies(logits, g, at, keys, b, b[f"t{j}"])
            ce = nn.losses.cross_entropy(logits, y, reduction="sum") + aux
            if soft:  # the backbone's distribution where it chose y: its state one position on
                h = b.get("clean", b["h"])[:, b["first"] :, :width].reshape(-1, width)
                teacher = mx.softmax(h[at + j] @ self.w.T, axis=-1)
                extra = logits.shape[-1] - teacher.shape[-1]  # a copy head's columns
                teacher = mx.pad(teacher, [(0, 0), (0, extra)]) if extra else teacher
                own = -(mx.stop_gradient(teacher) * nn.log_softmax(logits, axis=-1)).sum()
                ce = (1 - soft) * ce + soft * own
            total = total + self.cfg.decay ** (j - 1) * ce / (self.targets or max(1, at.size))
            hits.append((mx.argmax(logits, axis=-1) == y).sum())
        return total, mx.stack(hits)

    def _copy_keys(self, b: dict) -> mx.array:
        """The copy head's keys (B, L, r): of every position's fused input at depth 1."""
        tokens, length = b["tokens"], b["h"].shape[1]
        emb = backbone.embed(self.model, tokens[:, 1 : 1 + length])
        return self.layer.pointer.keys(self.layer.fuse(b["h"], emb))

    def _with_copies(self, logits, g, at, keys, b: dict, target):
        """The mixture's log-probabilities at the flat anchors ``at`` (whose
        outputs are ``g``, (n, d)), and the copy loss: minus the log of the
        attention on the positions that offer the ``target`` tokens, where
        one does (it teaches the pointer where to look while the mixture's
        weight on it is still small)."""
        anchors = b["h"].shape[1] - b["first"]
        row, s = at // anchors, at % anchors + b["first"]
        valid = (mx.arange(keys.shape[1])[None] < s[:, None])[:, None]  # (n, 1, L): m < s
        context = {name: v[row] for name, v in b["context"].items()}
        pointer = self.layer.pointer
        mixed = pointer.mix(logits[:, None], g[:, None], keys[row], valid, context)[:, 0]
        a, _ = pointer.attend(g[:, None], keys[row], valid & pointer.usable(context)[:, None])
        on = mx.sum(a[:, 0] * (b["offered"][row] == target[:, None]), axis=-1)
        aux = -mx.sum(mx.where(on > 0, mx.log(mx.maximum(on, 1e-30)), 0.0))
        return mixed, aux

    def batch_rows(self, step: int) -> np.ndarray:
        """The rows of step ``step``: drawn from all rows, or (group_by_length)
        from one group, chosen in proportion to its size, so that every row is
        as likely as without groups while a batch pads far fewer positions."""
        if self.cfg.passes:
            return self.pass_batches(step)
        rng = np.random.default_rng([self.cfg.seed, step])
        if self.groups is None:
            return rng.integers(0, len(self.rows), self.cfg.batch)
        sizes = np.array([len(g) for g in self.groups], dtype=np.float64)
        group = self.groups[rng.choice(len(sizes), p=sizes / sizes.sum())]
        return group[rng.integers(0, len(group), self.cfg.batch)]

    def pass_batches(self, step: int) -> np.ndarray:
        """With ``passes``: the rows of step ``step``. A pass reads every row
        once: each group's rows (all rows, without groups) in a seeded order,
        cut into batches of at most ``batch``, the batches in a seeded order."""
        groups = self.groups or [np.arange(len(self.rows))]
        per_pass = sum(-(-len(g) // self.cfg.batch) for g in groups)
        k, i = divmod(step, per_pass)
        if self._pass[0] != k:
            rng = np.random.default_rng([self.cfg.seed, k, 1])
            cut = [np.array_split(rng.permutation(g), -(-len(g) // self.cfg.batch)) for g in groups]
            batches = [b for c in cut for b in c]
            self._pass = (k, [batches[j] for j in rng.permutation(len(batches))])
        return self._pass[1][i]

    def batch(self, idx: np.ndarray, rows: Rows | None = None) -> dict:
        """Rows ``idx`` of ``rows`` (the training rows) as a batch, with the
        earlier layers' states if the layer reads them; training rows with
        their prompts' targets if the run trains on those (held-out checks
        stay on the greedy continuations, what decoding drafts)."""
        side = bool(self.layer.side_layers)
        greedy = self.prompt_greedy if rows is None and self.cfg.prompt_targets else None
        rows = self.rows if rows is None else rows
        copies = ""
        if "pointer" in self.layer:
            copies = "outside" if self.layer.pointer.outside else "inside"
        return batch(rows, idx, self.cfg.depths, self.id_map, side, greedy, copies)

    def prompt_greedy(self, i: int) -> np.ndarray:
        """The backbone's greedy token after each position of training row
        ``i``'s prompt (index ``p``: its argmax at ``p - 1``; the last is the
        row's first generated token), from the stored states; once a row."""
        if i not in self._prompt_greedy:
            h = mx.array(self.rows.prompt_hidden(i))
            chosen = np.array(mx.argmax(backbone.project(self.model, h), axis=-1))
            self._prompt_greedy[i] = np.concatenate([[-1], chosen])
        return self._prompt_greedy[i]

    def train_step(self) -> tuple[float, list[float]]:
        b = self.batch(self.batch_rows(self.step))
        if self.cfg.noise:  # the soft target stays the clean states'
            key = mx.random.key(self.cfg.seed * 1_000_003 + self.step)
            b["clean"] = b["h"]
            b["h"] = noisy(b["h"], self.cfg.noise, self.model.args.hidden_size, key)
        (loss, hits), grads = self._grad(b)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        self.opt.update(self.layer, grads)
        mx.eval(self.layer.parameters(), self.opt.state, loss, hits)
        self.step += 1
        acc = [h / max(1, b[f"all{j}"]) for j, h in enumerate(hits.tolist(), 1)]
        self.history.append({"step": self.step, "loss": round(loss.item(), 4), "acc": acc})
        return loss.item(), acc

    def held_accuracy(self, b: dict) -> list[float]:
        """Per depth, top-1 agreement on the batch ``b`` (held-out rows), as
        the training accuracy is measured (teacher-forced tokens)."""
        _, hits = self._loss(b)
        return [round(h / max(1, b[f"all{j}"]), 4) for j, h in enumerate(hits.tolist(), 1)]

    def curve(self) -> list[dict]:
        """The history at each held-out check: the step, the mean training
        accuracy since the check before, and the held-out accuracy."""
        out, since = [], []
        for h in self.history:
            since.append(h["acc"])
            if "held" in h:
                acc = np.mean(since, axis=0).round(4).tolist()
                out.append({"step": h["step"], "acc": acc, "held": h["held"]})
                since = []
        return out

    # -- checkpoints ---------------------------------------------------
    def save(self, folder: Path) -> None:
        arrays = dict(tree_flatten(self.layer.parameters(), prefix=".layer"))
        arrays.update(tree_flatten(self.opt.state, prefix=".opt"))
        arrays["vocab_ids"] = mx.array(self.vocab_ids.astype(np.int32))
        meta = {"step": self.step, "config": asdict(self.cfg), "history": self.history}
        save_checkpoint(folder, arrays, meta)

    def restore(self, folder: Path) -> bool:
        got = load_checkpoint(folder, asdict(self.cfg), defaults=ADDED)
        if got is None or not np.array_equal(np.array(got[0]["vocab_ids"]), self.vocab_ids):
            return False  # none, or another configuration or data: start afresh
        arrays, meta = got
        self.layer.load_weights(part(arrays, "layer"))
        self.opt.state = tree_unflatten(part(arrays, "opt"))
        self.step, self.history = meta["step"], meta["history"]
        return True


def noisy(h: mx.array, amount: float, width: int, key) -> mx.array:
    """``h`` (B, L, n * width: the last layer's states, then the side
    layers') with uniform noise in (-amount, amount) times each state's RMS
    added, as EAGLE's training adds noise to the target's features: the
    layer cannot learn a row by the exact values of its states."""
    b, length, wide = h.shape
    x = h.reshape(b, length, wide // width, width).astype(mx.float32)
    scale = mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True))
    u = mx.random.uniform(-amount, amount, x.shape, key=key)
    return (x + u * scale).astype(h.dtype).reshape(b, length, wide)


def to_bundle(trainer: MTPTrainer, name: str = ""):
    """The trained layer as a drafter bundle (heads format, design "mtp"):
    k = the depths trained, its draft vocabulary, CLP as initialised."""
    from ..model.heads_files import init_heads

    model, layer = trainer.model, trainer.layer
    bundle = init_heads(model, trainer.cfg.depths, design="mtp", gate=False, head0=False,
                        name=name, layer=layer.shape())  # fmt: skip
    bundle.mtp.update(layer.parameters())
    bundle.set_draft_vocab(trainer.vocab_ids.tolist())
    bundle.config.tree_branches = 1
    bundle.use_context(CONTEXT_NGRAM)  # verify drafts copies first where the context matches
    return bundle
