"""``python -m clp_mlx.train``: train MTP heads, CLP and the baselines on-device.

    python -m clp_mlx.train --data wiki.train.raw --out heads-05b          # train
    python -m clp_mlx.train --eval --heads heads-05b --data wiki.valid.raw  # evaluate
    python -m clp_mlx.train --eval --heads heads-05b --data DISTILLED       # its held-out rows

Phases: (1) backbone features, cached and resumable; (2) heads (and head 0),
checkpointed every N steps and resumable; (3) CLP and the gate on the frozen
heads (see :mod:`clp_mlx.train.fit`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..api import load_with_drafter as load
from ..errors import ClpError
from ..model.checks import seed
from ..model.heads import DESIGNS
from ..model.heads_checks import MAX_K, MAX_LOOKUP
from ..model.heads_files import holds_only_heads, load_heads
from ..paths import replace_refusal
from ..train.data import FeatureSource, features_for
from ..train.evaluate import evaluate
from ..train.fit import DecisionConfig, train
from ..train.trainer import TrainConfig
from .args import parser, run

DATA, DECISIONS = FeatureSource(), DecisionConfig()
TRAIN_FLAGS = ("k", "design", "steps", "batch", "lr", "draft_vocab", "seed", "checkpoint_every")


def setup_arg_parser() -> argparse.ArgumentParser:
    p = parser("python -m clp_mlx.train", __doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="as for generate (default: the 0.5B)")
    p.add_argument("--data", nargs="+", required=True, help="text files (WikiText raw, code, ...); for --eval also "
                   "self-distilled data folders (scored on their held-out rows)")
    p.add_argument("--out", help="heads folder to write (training)")
    p.add_argument("--heads", help="heads folder to evaluate (--eval)")
    p.add_argument("--eval", action="store_true", help="evaluate --heads on --data")
    p.add_argument("--by-confidence", action="store_true", help="--eval on self-distilled folders: "
                   "also t+2 by the backbone's own chance of its token (one more output projection)")
    p.add_argument("--work-dir", help="features and checkpoints (default: <out>.work)")
    p.add_argument("--k", type=int, default=TrainConfig.k)
    p.add_argument("--design", choices=DESIGNS, default=TrainConfig.design)
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--batch", type=int, default=TrainConfig.batch)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--draft-vocab", type=int, default=TrainConfig.draft_vocab)
    _add_data_args(p)
    p.add_argument("--checkpoint-every", type=int, default=TrainConfig.checkpoint_every)
    _add_decision_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    return p


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """What the features are of: :class:`FeatureSource`."""
    p.add_argument(
        "--source",
        choices=("greedy", "text"),
        default=DATA.source,
        help="greedy: train on the backbone's own greedy continuations of prompts cut from "
        "--data (what decoding sees; default); text: on --data itself, teacher-forced "
        "(CLP and the gate still learn on greedy continuations of later prompts)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=DATA.prompt_tokens,
        help="prompt length of greedy continuations "
        "(--source greedy; held-out rows of --source text)",
    )
    p.add_argument(
        "--new-tokens",
        type=int,
        default=DATA.new_tokens,
        help="tokens those continuations generate",
    )
    p.add_argument("--seq-len", type=int, default=DATA.seq_len, help="--source text: row length")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=DATA.max_tokens,
        help="feature budget, in tokens (all rows)",
    )


def _add_decision_args(p: argparse.ArgumentParser) -> None:
    """How CLP and the gate are fitted: :class:`DecisionConfig`."""
    p.add_argument(
        "--decision-steps",
        type=int,
        default=DECISIONS.steps,
        help="Adam steps for CLP and the gate",
    )
    p.add_argument(
        "--lookup",
        type=int,
        default=DECISIONS.lookup,
        help="context drafts: copy from the longest earlier match of the last 1..N tokens "
        "where there is one (CLP is fitted knowing which); 0: the heads' drafts only",
    )
    p.add_argument(
        "--clp-l2",
        type=float,
        default=DECISIONS.clp_l2,
        help="L2 penalty on CLP's weights (chosen on WikiText-2 valid continuations)",
    )


def main(argv=None, *, stop_after: int | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    seed(args.seed, "--seed")
    for name in ("prompt_tokens", "new_tokens", "seq_len", "max_tokens", "k", "steps", "batch"):
        if getattr(args, name) < 1:
            raise ClpError(f"--{name.replace('_', '-')} must be at least 1")
    if args.lookup < 0 or args.clp_l2 < 0 or args.draft_vocab < 0:
        raise ClpError("--lookup, --clp-l2 and --draft-vocab must be 0 or more")
    if args.k > MAX_K or args.lookup > MAX_LOOKUP:
        raise ClpError(f"--k must be at most {MAX_K} and --lookup at most {MAX_LOOKUP}")
    if not 0 < args.lr < float("inf") or args.checkpoint_every < 1 or args.decision_steps < 0:
        raise ClpError("--lr must be above 0, --checkpoint-every 1 or more, --decision-steps 0 or more")
    source = FeatureSource(
        args.source, args.prompt_tokens, args.new_tokens, args.seq_len, args.max_tokens
    )
    if args.by_confidence and not args.eval:
        raise ClpError("--by-confidence goes with --eval")
    if args.eval:
        return _evaluate(args, source)
    if not args.out:
        raise ClpError("training needs --out FOLDER for the heads")
    if Path(args.out).exists() and not args.force:
        raise ClpError(f"{args.out} exists; pass --force to replace it")
    why = replace_refusal(args.out, holds_only_heads)  # before hours of training, not after
    if why is not None:
        raise ClpError(f"--out {args.out}: will not replace it: {why}")
    cfg = TrainConfig(**{name: getattr(args, name) for name in TRAIN_FLAGS})
    started = time.perf_counter()
    model, tokenizer, _ = load(args.model, None)
    report = train(
        model,
        tokenizer,
        args.data,
        args.out,
        work=Path(args.work_dir or f"{args.out}.work"),
        source=source,
        cfg=cfg,
        decisions=DecisionConfig(args.lookup, args.decision_steps, args.clp_l2),
        name=str(args.model or ""),
        command="python -m clp_mlx.train " + " ".join(argv if argv is not None else sys.argv[1:]),
        force=args.force,
        started=started,
        stop_after=stop_after,
    )
    print(json.dumps({k: report[k] for k in ("seconds", "decisions")}, indent=1))
    return 0


def _evaluate(args, source: FeatureSource) -> int:
    if not args.heads:
        raise ClpError("--eval needs --heads FOLDER")
    distilled = [(Path(d) / "manifest.json").is_file() for d in args.data]
    if any(distilled) and not all(distilled):  # refused before the model is read
        raise ClpError("--eval: give text files or self-distilled data folders, not both")
    if args.by_confidence and not all(distilled):
        raise ClpError("--by-confidence needs self-distilled data folders (distill)")
    model, tokenizer, _ = load(args.model, None)
    bundle = load_heads(args.heads, model)
    if all(distilled):
        return _evaluate_rows(args, model, bundle)
    work = Path(args.work_dir or f"{args.heads}.eval-work")
    data = features_for(model, tokenizer, args.data, work, bundle.k, source, seed=args.seed)
    print(json.dumps(evaluate(model, bundle, data, args.seed), indent=1))
    return 0


def _evaluate_rows(args, model, bundle) -> int:
    """Self-distilled data folders: the drafter on their held-out rows."""
    from ..decode.config import DecodeConfig
    from ..decode.feed import pass_costs
    from ..train.rows_eval import score_folders

    # As default verify feeds an MTP layer's drafts here: as many a pass, at
    # this machine's pass costs, with runners-up unless it feeds chains only.
    costs, leaves = None, True
    if bundle.config.design == "mtp":
        verify = DecodeConfig(mode="verify").resolve(model, bundle)
        costs, leaves = pass_costs(model, verify.draft_len + 1), verify.tree is None
    report = score_folders(
        model, bundle, args.data, args.lookup, args.by_confidence, costs, leaves
    )
    print(json.dumps(report, indent=1))
    return 0


def cli() -> None:
    run(main)


if __name__ == "__main__":
    cli()
