"""``python -m clp_mlx.train``: train MTP heads, CLP and the baselines on-device.

    python -m clp_mlx.train --data wiki.train.raw --out heads-05b          # train
    python -m clp_mlx.train --eval --heads heads-05b --data wiki.valid.raw  # evaluate

Phases: (1) backbone features, cached and resumable; (2) heads (and head 0),
checkpointed every N steps and resumable; (3) CLP and the gate on the frozen
heads. CLP's label at a position is the longest run of heads 1..n whose draft
equals the backbone's own greedy choice there: that is what verify accepts
and what keeps clp mode's output close to the backbone's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from .args import run
from ..errors import ClpError
from ..train.features import continue_greedily, extract, load_features, tokenize_files
from ..model.heads import DESIGNS, init_heads, load_heads, save_heads
from ..decode.lookup import row_drafts
from ..train.trainer import (
    HeadTrainer,
    Positions,
    TrainConfig,
    draft_vocabulary,
    elapsed,
    head_drafts,
    run_lengths,
    walked_tokens_per_pass,
)

SMALL_SAMPLE = 4096  # positions for CLP/gate training and evaluation
WALK_POSITIONS = 2 * SMALL_SAMPLE  # --eval walks whole rows, up to this many positions
HELD_SHARE = 0.1  # rows (whole prompts) kept out of head training
HELD_SAMPLE = 1024  # held-out positions checked at every checkpoint


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


def sampled_drafts(model, bundle, data: Positions, n: int, seed: list, lookup: int = 0):
    """``n`` positions of ``data`` drawn with ``seed``, the heads' drafts
    there (n, k), the drafts decoding makes there (with ``lookup``, the
    context's copy where it has a match; else the heads') and the match
    lengths (n,). The heads run once for both."""
    idx = np.random.default_rng(seed).choice(len(data), min(len(data), n), replace=False)
    return drafts_at(model, bundle, data, idx, lookup)


def drafts_at(model, bundle, data: Positions, idx: np.ndarray, lookup: int = 0):
    """As :func:`sampled_drafts`, at the positions ``idx`` of ``data``."""
    at = data.index[idx]
    heads = head_drafts(model, bundle, data, idx)
    if not lookup:
        return at, heads, heads, np.zeros(at.size, dtype=np.int64)
    copied, match = row_drafts(data.rows, at, bundle.k, lookup)
    return at, heads, np.where(match[:, None] > 0, copied, heads), match


def scores(data: Positions, at: np.ndarray, drafts: np.ndarray):
    """Per draft, whether it equals the backbone's greedy token and the
    text's token at its position: both (n, k)."""
    ahead = at[:, None] + np.arange(1, drafts.shape[1] + 1)[None]
    return drafts == data.greedy[ahead], drafts == data.tokens[ahead + 1]


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
    bundle.freeze()
    bundle.clp.unfreeze()
    if lookup:
        bundle.unfreeze(keys=["clp_context"], recurse=False)

    def clp_loss(b):
        logits = bundle.clp_logits(b["h"], b["m"] if lookup else None)
        ce = nn.losses.cross_entropy(logits, b["y"], reduction="mean")
        return ce + l2 * mx.sum(mx.square(bundle.clp.weight))

    targets = {"h": h, "y": mx.array(label), "m": mx.array(match)}
    clp_loss_end = fit_small(bundle, clp_loss, targets, steps, seed=seed)
    out = {
        "clp_loss": clp_loss_end,
        "label_histogram": np.bincount(label, minlength=bundle.k + 1).tolist(),
        "context_match_share": round(float((match > 0).mean()), 4),
    }
    if lookup:
        out["with_context_agree_with_greedy"] = agree.mean(axis=0).round(4).tolist()
        out["with_context_mean_run_greedy"] = float(label.mean())
        agree, truth = scores(data, at, heads)
    if "gate" in bundle:
        bundle.freeze()
        bundle.gate.unfreeze()

        def gate_loss(b):
            return nn.losses.binary_cross_entropy(bundle.gate(b["h"]), b["y"], reduction="mean")

        targets = {"h": h, "y": mx.array(agree.astype(np.float32))}
        out["gate_loss"] = fit_small(bundle, gate_loss, targets, steps, seed=seed)
    bundle.unfreeze()
    out["agree_with_greedy"] = agree.mean(axis=0).round(4).tolist()
    out["agree_with_text"] = truth.mean(axis=0).round(4).tolist()
    out["mean_run_greedy"] = float(run_lengths(agree).mean())
    out["mean_run_text"] = float(run_lengths(truth).mean())
    return out


def evaluate(model, bundle, data: Positions, seed: int = 0, n: int = SMALL_SAMPLE) -> dict:
    """Top-1 of each head vs the backbone's greedy and vs the text, alone and
    (bundles with context drafts) as decoding drafts; CLP's confusion."""
    lookup = bundle.config.lookup
    at, heads, drafts, match = sampled_drafts(model, bundle, data, n, [seed, 2], lookup)
    agree, truth = scores(data, at, heads)
    backbone_acc = float((data.greedy[at] == data.tokens[at + 1]).mean())
    out = {
        "positions": int(at.size),
        "head_top1_vs_greedy": agree.mean(axis=0).round(4).tolist(),
        "head_top1_vs_text": truth.mean(axis=0).round(4).tolist(),
        "backbone_top1_vs_text": round(backbone_acc, 4),
        "expected_tokens_per_pass_verify": round(1 + float(run_lengths(agree).mean()), 3),
    }
    if lookup:
        agree, truth = scores(data, at, drafts)
        out["with_context_drafts"] = {
            "draft_top1_vs_greedy": agree.mean(axis=0).round(4).tolist(),
            "draft_top1_vs_text": truth.mean(axis=0).round(4).tolist(),
            "context_match_share": round(float((match > 0).mean()), 4),
            "expected_tokens_per_pass_verify": round(1 + float(run_lengths(agree).mean()), 3),
        }
    out["chain_verify_tokens_per_pass"] = walked_verify(model, bundle, data)
    label = run_lengths(agree)
    h = mx.array(data.hidden[at], dtype=mx.float32)
    pred = np.array(bundle.clp_length(h, mx.array(match) if lookup else None))
    confusion = np.zeros((bundle.k + 1, bundle.k + 1), dtype=int)
    np.add.at(confusion, (label, pred), 1)
    out["clp_confusion_rows_label_cols_pred"] = confusion.tolist()
    out["clp_accuracy"] = round(float(np.trace(confusion) / at.size), 4)
    return out


def walked_verify(model, bundle, data: Positions) -> dict:
    """Tokens per pass of chain verify, walking every row as decoding does:
    with the heads' drafts alone and (bundles with context drafts) with the
    drafts decoding makes. 1 + the mean run over positions counts a long
    run once per position inside it; decoding passes over it once. The
    first rows up to WALK_POSITIONS: drafting every position of a large
    --max-tokens would cost minutes per thousand rows."""
    rows = max(1, WALK_POSITIONS // data.per_row)
    first = np.arange(min(len(data), rows * data.per_row))  # index is row-major
    at, heads, drafts, _ = drafts_at(model, bundle, data, first, bundle.config.lookup)

    def walk(d):
        runs = run_lengths(scores(data, at, d)[0]).reshape(-1, data.per_row)
        return round(walked_tokens_per_pass(runs), 3)

    out = {"heads": walk(heads)}
    if bundle.config.lookup:
        out["with_context"] = walk(drafts)
    return out


PROMPT_STRIDE = 4  # prompts for --source greedy: one per 4 prompt lengths of text


def split_rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows for the heads, and held-out rows (whole prompts, never trained on).

    Positions of one continuation share its content, so a held-out *position*
    of a trained row flatters the heads (0.5B: 71% vs 41% for new prompts).
    The held-out rows give the honest curve in the report and train CLP and
    the gate, whose labels must reflect how the heads do on unseen text.
    """
    if n < 2:
        raise ClpError("training needs at least 2 rows of features; give more text")
    order = np.random.default_rng([seed, 3]).permutation(n)
    held = max(1, round(n * HELD_SHARE))
    return np.sort(order[held:]), np.sort(order[:held])


def features_for(model, tokenizer, args, folder: Path, k: int, split: bool = False):
    """Backbone features for ``args.data``, extracted once into ``folder``:
    all their positions, or (``split``) those of the training and held-out rows.

    With ``--source text`` the held-out rows are greedy continuations of
    prompts cut from the text after the training rows: CLP and the gate
    learn there how often drafts pass, and that must be measured on what
    decoding meets (the backbone's own text is easier to draft than a
    human's), not on more teacher-forced text.
    """
    span = args.prompt_tokens * PROMPT_STRIDE
    if args.source == "text":
        tokens = tokenize_files(
            tokenizer, args.data, seq_len=args.seq_len, max_tokens=args.max_tokens
        )
        extract(model, tokens, folder)
        if split:
            rows = max(2, round(HELD_SHARE * tokens.size / (args.prompt_tokens + args.new_tokens)))
            flat = tokenize_files(tokenizer, args.data, seq_len=1, max_tokens=tokens.size + rows * span)
            rest = flat.reshape(-1)[tokens.size :]
            if rest.size < span:
                raise ClpError(
                    "no text is left after the training rows for held-out prompts; "
                    "give more text or lower --max-tokens"
                )
            prompts = rest[: rest.size // span * span].reshape(-1, span)[:, : args.prompt_tokens]
            held_folder = folder.with_name(folder.name + "-held")
            continue_greedily(model, prompts, held_folder, new_tokens=args.new_tokens)
            return _positions(folder, k), _positions(held_folder, k)
    else:
        n = max(1, args.max_tokens // (args.prompt_tokens + args.new_tokens))
        text = tokenize_files(tokenizer, args.data, seq_len=span, max_tokens=n * span)
        continue_greedily(model, text[:, : args.prompt_tokens], folder, new_tokens=args.new_tokens)
        if split:
            tokens, hidden, greedy_ids, start = _features(folder, k)
            rows = split_rows(tokens.shape[0], args.seed)
            return tuple(Positions(tokens, hidden, greedy_ids, k, start, r) for r in rows)
    return _positions(folder, k)


def _features(folder: Path, k: int) -> tuple:
    tokens, hidden, greedy_ids, start = load_features(folder)
    if tokens.shape[1] - max(start, 0) <= k + 1:
        raise ClpError(
            f"rows of {tokens.shape[1]} tokens leave no position with {k} drafts to learn; "
            "raise --new-tokens (or --seq-len) above k + 1"
        )
    return tokens, hidden, greedy_ids, start


def _positions(folder: Path, k: int) -> Positions:
    tokens, hidden, greedy_ids, start = _features(folder, k)
    return Positions(tokens, hidden, greedy_ids, k, start)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m clp_mlx.train", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="as for generate (default: the 0.5B)")
    p.add_argument("--data", nargs="+", required=True, help="text files (WikiText raw, code, ...)")
    p.add_argument("--out", help="heads folder to write (training)")
    p.add_argument("--heads", help="heads folder to evaluate (--eval)")
    p.add_argument("--eval", action="store_true", help="evaluate --heads on --data")
    p.add_argument("--work-dir", help="features and checkpoints (default: <out>.work)")
    p.add_argument("--k", type=int, default=TrainConfig.k)
    p.add_argument("--design", choices=DESIGNS, default=TrainConfig.design)
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--batch", type=int, default=TrainConfig.batch)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--draft-vocab", type=int, default=TrainConfig.draft_vocab)
    p.add_argument(
        "--source",
        choices=("greedy", "text"),
        default="greedy",
        help="greedy: train on the backbone's own greedy continuations of prompts cut from "
        "--data (what decoding sees; default); text: on --data itself, teacher-forced "
        "(CLP and the gate still learn on greedy continuations of later prompts)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=32,
        help="prompt length of greedy continuations (--source greedy; held-out rows of --source text)",
    )
    p.add_argument("--new-tokens", type=int, default=80, help="tokens those continuations generate")
    p.add_argument("--seq-len", type=int, default=256, help="--source text: row length")
    p.add_argument(
        "--max-tokens", type=int, default=120_000, help="feature budget, in tokens (all rows)"
    )
    p.add_argument("--checkpoint-every", type=int, default=TrainConfig.checkpoint_every)
    p.add_argument(
        "--decision-steps", type=int, default=300, help="Adam steps for CLP and the gate"
    )
    p.add_argument(
        "--lookup",
        type=int,
        default=3,
        help="context drafts: copy from the longest earlier match of the last 1..N tokens "
        "where there is one (CLP is fitted knowing which); 0: the heads' drafts only",
    )
    p.add_argument(
        "--clp-l2",
        type=float,
        default=0.3,
        help="L2 penalty on CLP's weights (chosen on WikiText-2 valid continuations)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    return p


def main(argv=None, *, stop_after: int | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    for name in ("prompt_tokens", "new_tokens", "seq_len", "max_tokens", "k", "steps", "batch"):
        if getattr(args, name) < 1:
            raise ClpError(f"--{name.replace('_', '-')} must be at least 1")
    if args.lookup < 0 or args.clp_l2 < 0:
        raise ClpError("--lookup and --clp-l2 must be 0 or more")
    from ..api import load

    if args.eval:
        if not args.heads:
            raise ClpError("--eval needs --heads FOLDER")
        model, tokenizer, _ = load(args.model, None)
        bundle = load_heads(args.heads, model)
        work = Path(args.work_dir or f"{args.heads}.eval-work")
        data = features_for(model, tokenizer, args, work, bundle.k)
        print(json.dumps(evaluate(model, bundle, data, args.seed), indent=1))
        return 0
    if not args.out:
        raise ClpError("training needs --out FOLDER for the heads")
    if Path(args.out).exists() and not args.force:
        raise ClpError(f"{args.out} exists; pass --force to replace it")
    cfg = TrainConfig(
        k=args.k,
        design=args.design,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        draft_vocab=args.draft_vocab,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
    )
    t0 = time.perf_counter()
    model, tokenizer, _ = load(args.model, None)
    work = Path(args.work_dir or f"{args.out}.work")
    data, held = features_for(model, tokenizer, args, work / "features", cfg.k, split=True)
    t_features = elapsed(t0)
    vocab_ids = draft_vocabulary(data.greedy, cfg.draft_vocab, model.args.vocab_size)
    coverage = float(np.isin(data.greedy, vocab_ids).mean())
    bundle = init_heads(model, cfg.k, design=cfg.design, seed=cfg.seed, name=str(args.model or ""))
    bundle.set_dtype(mx.float32)
    bundle.set_draft_vocab(vocab_ids)
    trainer = HeadTrainer(model, bundle, data, cfg, vocab_ids)
    resumed = trainer.step if trainer.restore(work / "checkpoint") else 0
    if resumed:
        print(f"resuming at step {resumed}", file=sys.stderr)
    history = _train_loop(trainer, work, stop_after, held)
    t_heads = elapsed(t0)
    bundle.use_context(args.lookup)
    bundle.config.clp_norm = True
    decisions = train_decisions(model, bundle, held, cfg.seed, args.decision_steps, args.clp_l2)
    report = {
        "command": "python -m clp_mlx.train "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "data": [Path(d).name for d in args.data],
        "train_tokens": int(data.tokens.size),
        "train_positions": len(data),
        "held_out_positions": len(held),
        "resumed_at_step": resumed,  # "seconds" then counts this run's work only
        "config": cfg.__dict__,
        "draft_vocab_coverage": round(coverage, 4),
        "seconds": {"features": t_features, "heads": t_heads - t_features, "total": elapsed(t0)},
        "history": history,
        "decisions": decisions,
        "backbone_fingerprint": bundle.config.fingerprint,
    }
    save_heads(bundle, args.out, force=args.force, extra={"training": report})
    _plot(history, Path(args.out) / "training.png")
    (Path(args.out) / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("seconds", "decisions")}, indent=1))
    return 0


def held_agreement(trainer: HeadTrainer, held: Positions) -> list:
    """Each head's agreement with greedy decoding on held-out prompts."""
    seed = [trainer.cfg.seed, 4]
    at, heads, _, _ = sampled_drafts(trainer.model, trainer.bundle, held, HELD_SAMPLE, seed)
    agree, _ = scores(held, at, heads)
    return agree.mean(axis=0).round(4).tolist()


def _train_loop(trainer: HeadTrainer, work: Path, stop_after: int | None, held) -> list:
    from tqdm import tqdm

    cfg = trainer.cfg
    history_path = work / "checkpoint" / "history.json"
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
            trainer.save(work / "checkpoint")
            history_path.write_text(json.dumps(history))
        if stop_after is not None and trainer.step >= stop_after:
            raise KeyboardInterrupt  # tests: an interrupt right after a checkpoint
    bar.close()
    return history


def _plot(history: list, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return  # the plot is optional: pip install matplotlib
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 4))
    for i in range(len(history[0]["acc"]) if history else 0):
        line = ax.plot(steps, [h["acc"][i] for h in history], label=f"head {i + 1} (t+{i + 2})")
        if "held" in history[0]:
            held = [h["held"][i] for h in history]
            ax.plot(steps, held, "--", color=line[0].get_color(), label=f"head {i + 1}, held out")
    ax.set_xlabel("step")
    ax.set_ylabel("top-1 vs backbone greedy (solid: batch, teacher-forced)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cli() -> None:
    run(main)


if __name__ == "__main__":
    cli()
