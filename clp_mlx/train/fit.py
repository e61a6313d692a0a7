"""Training, phase by phase: backbone features, the heads (and head 0),
checkpointed and resumable, then CLP and the gate on the frozen heads; the
heads folder with its training report.

CLP's label at a position is the longest run of heads 1..n whose draft
equals the backbone's own greedy choice there: that is what verify accepts
and what keeps clp mode's output close to the backbone's.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn

from ..model.heads_files import init_heads, save_heads
from ..paths import write_text
from .data import FeatureSource, features_for
from .evaluate import SMALL_SAMPLE, sampled_drafts, scores
from .trainer import HeadTrainer, Positions, TrainConfig, draft_vocabulary, elapsed, run_lengths

HELD_SAMPLE = 1024  # held-out positions checked at every checkpoint


@dataclass
class DecisionConfig:
    """How CLP and the gate are fitted on the frozen heads (see :func:`train_decisions`)."""

    lookup: int = 3  # context drafts: longest earlier match of the last 1..N tokens; 0: none
    steps: int = 300  # Adam steps
    clp_l2: float = 0.3  # L2 penalty on CLP's weights


def train(
    model,
    tokenizer,
    files: list[str],
    out: str | Path,
    *,
    work: Path,
    source: FeatureSource,
    cfg: TrainConfig,
    decisions: DecisionConfig,
    name: str = "",
    command: str = "",
    force: bool = False,
    started: float | None = None,
    stop_after: int | None = None,
) -> dict:
    """Train heads for ``model`` on the text ``files`` and write them, with
    the training report (returned), to ``out``. Features and checkpoints go
    to ``work``: a rerun resumes there. ``started``: the clock's start for
    the report's seconds (default: now); ``stop_after``: interrupt after the
    checkpoint at that step (tests)."""
    t0 = time.perf_counter() if started is None else started
    data, held = features_for(
        model, tokenizer, files, work / "features", cfg.k, source, seed=cfg.seed, split=True
    )
    t_features = elapsed(t0)
    vocab_ids = draft_vocabulary(data.greedy, cfg.draft_vocab, model.args.vocab_size)
    bundle = init_heads(model, cfg.k, design=cfg.design, seed=cfg.seed, name=name)
    bundle.set_dtype(mx.float32)
    bundle.set_draft_vocab(vocab_ids)
    trainer = HeadTrainer(model, bundle, data, cfg, vocab_ids)
    resumed = trainer.step if trainer.restore(work / "checkpoint") else 0
    if resumed:
        print(f"resuming at step {resumed}", file=sys.stderr)
    history = train_loop(trainer, work / "checkpoint", held, stop_after)
    t_heads = elapsed(t0)
    bundle.use_context(decisions.lookup)
    bundle.config.clp_norm = True
    fitted = train_decisions(model, bundle, held, cfg.seed, decisions.steps, decisions.clp_l2)
    report = {
        "command": command,
        "data": [Path(d).name for d in files],
        "train_tokens": int(data.tokens.size),
        "train_positions": len(data),
        "held_out_positions": len(held),
        "resumed_at_step": resumed,  # "seconds" then counts this run's work only
        "config": cfg.__dict__,
        "draft_vocab_coverage": round(float(np.isin(data.greedy, vocab_ids).mean()), 4),
        "seconds": {"features": t_features, "heads": t_heads - t_features, "total": elapsed(t0)},
        "history": history,
        "decisions": fitted,
        "backbone_fingerprint": bundle.config.fingerprint,
    }
    save_heads(bundle, out, force=force, extra={"training": report})
    plot_history(history, Path(out) / "training.png")
    write_text(Path(out) / "training.json", json.dumps(report, indent=1) + "\n")
    return report


def train_loop(trainer: HeadTrainer, checkpoint: Path, held: Positions, stop_after=None) -> list:
    """Train the heads to ``trainer.cfg.steps``, checkpointing into ``checkpoint``
    (with the history so far) every ``checkpoint_every`` steps; the history:
    per checkpoint, mean loss and accuracy since the last and held-out agreement."""
    from tqdm import tqdm

    cfg = trainer.cfg
    history_path = checkpoint / "history.json"
    history = json.loads(history_path.read_text()) if trainer.step and history_path.exists() else []
    bar = tqdm(total=cfg.steps, initial=trainer.step, desc="heads", unit="step")
    window = []  # (loss, acc) since the last checkpoint, averaged into the history
    while trainer.step < cfg.steps:
        loss, acc = trainer.train_step()
        window.append([loss, *acc])
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", acc="/".join(f"{a:.2f}" for a in acc))
        if trainer.step % cfg.checkpoint_every == 0 or trainer.step == cfg.steps:
            mean = np.mean(window, axis=0).round(4).tolist()
            history.append(
                {
                    "step": trainer.step,
                    "loss": mean[0],
                    "acc": mean[1:],
                    "held": held_agreement(trainer, held),
                }
            )
            bar.write(f"step {trainer.step}: held-out agreement {history[-1]['held']}")
            window = []
            trainer.save(checkpoint)
            write_text(history_path, json.dumps(history))
        if stop_after is not None and trainer.step >= stop_after:
            raise KeyboardInterrupt  # tests: an interrupt right after a checkpoint
    bar.close()
    return history


def held_agreement(trainer: HeadTrainer, held: Positions) -> list:
    """Each head's agreement with greedy decoding on held-out prompts."""
    seed = [trainer.cfg.seed, 4]
    at, heads, _, _ = sampled_drafts(trainer.model, trainer.bundle, held, HELD_SAMPLE, seed)
    agree, _ = scores(held, at, heads)
    return agree.mean(axis=0).round(4).tolist()


def fit_small(module, loss_fn, data: dict, steps: int = 300, lr: float = 3e-3, seed: int = 0):
    """Full-batch-ish Adam on a small module (CLP or the gate)."""
    opt = optim.Adam(learning_rate=lr)
    grad = nn.value_and_grad(module, loss_fn)
    n = next(iter(data.values())).shape[0]
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = mx.array(rng.integers(0, n, min(n, 1024)))
        loss, g = grad({k: v[idx] for k, v in data.items()})
        opt.update(module, g)
        mx.eval(module.parameters(), opt.state)
    return loss.item()


def train_decisions(model, bundle, data: Positions, seed: int, steps: int, l2: float = 0.0) -> dict:
    """CLP and the gate, trained on the frozen heads' drafts at ``data``
    (the held-out rows: their labels must reflect unseen text). CLP learns
    from the drafts decoding uses (context copies where the bundle has
    them); the gate, the paper's baseline, from the heads' alone. ``l2``
    penalises CLP's weights: held-out positions are few next to the
    hidden size (1.5B: 2.3k positions, 1536 inputs) and an unpenalised CLP
    learns them by heart and then accepts wrong drafts with confidence."""
    lookup = bundle.config.lookup
    at, heads, drafts, match = sampled_drafts(
        model, bundle, data, 4 * SMALL_SAMPLE, [seed, 1], lookup
    )
    agree, truth = scores(data, at, drafts)
    label = run_lengths(agree)
    h = mx.array(data.hidden[at], dtype=mx.float32)
    out = {
        "clp_loss": _fit_clp(bundle, h, label, match, seed, steps, l2),
        "label_histogram": np.bincount(label, minlength=bundle.k + 1).tolist(),
        "context_match_share": round(float((match > 0).mean()), 4),
    }
    if lookup:
        out["with_context_agree_with_greedy"] = agree.mean(axis=0).round(4).tolist()
        out["with_context_mean_run_greedy"] = float(label.mean())
        agree, truth = scores(data, at, heads)
    if "gate" in bundle:
        out["gate_loss"] = _fit_gate(bundle, h, agree, seed, steps)
    bundle.unfreeze()
    out["agree_with_greedy"] = agree.mean(axis=0).round(4).tolist()
    out["agree_with_text"] = truth.mean(axis=0).round(4).tolist()
    out["mean_run_greedy"] = float(run_lengths(agree).mean())
    out["mean_run_text"] = float(run_lengths(truth).mean())
    return out


def _fit_clp(bundle, h, label, match, seed: int, steps: int, l2: float) -> float:
    """Fit CLP (and its context-match input) alone; its final loss."""
    lookup = bundle.config.lookup
    bundle.freeze()
    bundle.clp.unfreeze()
    if lookup:
        bundle.unfreeze(keys=["clp_context"], recurse=False)

    def clp_loss(b):
        logits = bundle.clp_logits(b["h"], b["m"] if lookup else None)
        ce = nn.losses.cross_entropy(logits, b["y"], reduction="mean")
        return ce + l2 * mx.sum(mx.square(bundle.clp.weight))

    targets = {"h": h, "y": mx.array(label), "m": mx.array(match)}
    return fit_small(bundle, clp_loss, targets, steps, seed=seed)


def _fit_gate(bundle, h, agree, seed: int, steps: int) -> float:
    """Fit the gate alone on whether each head's draft passes; its final loss."""
    bundle.freeze()
    bundle.gate.unfreeze()

    def gate_loss(b):
        return nn.losses.binary_cross_entropy(bundle.gate(b["h"]), b["y"], reduction="mean")

    targets = {"h": h, "y": mx.array(agree.astype(np.float32))}
    return fit_small(bundle, gate_loss, targets, steps, seed=seed)


def plot_history(history: list, path: Path, part: str = "head") -> None:
    """The accuracy curves of the training report, if matplotlib is installed
    (none for an empty history)."""
    if not history:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return  # the plot is optional: pip install matplotlib
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 4))
    for i in range(len(history[0]["acc"])):
        line = ax.plot(steps, [h["acc"][i] for h in history], label=f"{part} {i + 1} (t+{i + 2})")
        if "held" in history[0]:
            held = [h["held"][i] for h in history]
            ax.plot(steps, held, "--", color=line[0].get_color(), label=f"{part} {i + 1}, held out")
    ax.set_xlabel("step")
    ax.set_ylabel("top-1 vs backbone greedy")
    ax.set_title("solid: training batches, dashed: held out (teacher-forced)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
