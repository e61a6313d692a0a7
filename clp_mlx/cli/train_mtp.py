"""``python -m clp_mlx.cli.train_mtp``: train the MTP layer on self-distilled data.

    python -m clp_mlx.cli.train_mtp --data D/wikitext D/code D/magpie --out mtp-05b
    python -m clp_mlx.cli.train_mtp --data D/wikitext --out mtp-05b --eval

``--data``: folders that ``python -m clp_mlx.cli.distill`` wrote (docs/DATA.md),
for the same backbone. Training is checkpointed in ``--out`` every
``--checkpoint-every`` steps and goes on from there when run again with the
same flags; ``--eval`` scores the checkpoint on the held-out rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from ..errors import ClpError
from ..model.heads_checks import MAX_LOOKUP
from ..train.mtp_trainer import MTPTrainConfig
from .args import parser, run

COMMAND = "python -m clp_mlx.cli.train_mtp"
HELP = {
    "depths": "drafts a pass at most: depths trained, each reading the one before",
    "mlp_size": "the layer's MLP width (0: the backbone's)",
    "steps": "optimizer steps (cosine decay to lr/10 after the warm-up)",
    "batch": "whole rows a step",
    "lr": "peak learning rate (AdamW)",
    "warmup": "steps of linear warm-up",
    "decay": "loss weight of depth j is decay ** (j - 1)",
    "draft_vocab": "the draft vocabulary: the most frequent greedy tokens of --data "
    "(then --init-from's, where the data holds fewer)",
    "seed": "row order and initial weights",
    "soft": "weight of the backbone's whole distribution as the target (1 - soft: its token)",
    "init_from": "a drafter folder (an MTP layer of these flags' shape, for this backbone) "
    "to start from, e.g. to go on training it on more data; a wider --mlp-size than its "
    "layer's widens it (the new units' outputs start at zero: the same drafts at step 0)",
    "keep_vocab": "with --init-from: keep its draft vocabulary (else --data chooses one), "
    "e.g. to tune it on one kind of text without losing the tokens of the others",
    "group_by_length": "draw each step's rows from one group of rows of about one length: "
    "fewer padded positions a step, each row as likely as without",
    "side": "depth 1 also reads the earlier layers' states that --data keeps "
    "(distill --side-layers), as EAGLE-3's draft head; they start with no weight",
    "side_lr": "with --side: peak learning rate of the projection of the earlier layers' states, "
    "which starts at zero (0: --lr)",
    "prompt_targets": "also train at the rows' prompt positions, each on the backbone's "
    "greedy token there (EAGLE trains on fixed text so): more targets from the same data",
    "pointer": "rank of a copy head beside the layer, drafting tokens the context has shown "
    "(docs/DRAFTERS.md; 0: none)",
    "pointer_lr": "with --pointer: the copy head's peak learning rate (0: --lr)",
    "pointer_only": "with --pointer and --init-from: train the copy head alone, the layer "
    "kept as it is",
    "pointer_outside": "with --pointer: it also copies tokens outside the draft vocabulary",
    "noise": "training steps read each backbone state plus uniform noise of up to this "
    "share of its RMS (EAGLE's feature noise: against learning rows by heart; 0: none)",
    "passes": "read the rows in passes, every row once a pass, in a seeded order "
    "(else each step's rows are drawn at random, and some come round before others are read)",
}
FLAGS = tuple(HELP)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = parser(COMMAND, __doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="as for generate (default: the 0.5B)")
    p.add_argument("--data", nargs="+", required=True, help="self-distilled data folders")
    p.add_argument("--out", required=True, help="checkpoint folder (made, or resumed)")
    p.add_argument("--eval", action="store_true", help="score --out on the held-out rows")
    defaults = MTPTrainConfig()
    for name in FLAGS:
        value = getattr(defaults, name)
        flag, shown = "--" + name.replace("_", "-"), value if value != "" else "none"
        if isinstance(value, bool):
            p.add_argument(flag, action="store_true", help=HELP[name])
            continue
        p.add_argument(flag, type=type(value), default=value,
                       help=f"{HELP[name]} (default {shown})")  # fmt: skip
    every = defaults.checkpoint_every
    p.add_argument("--checkpoint-every", type=int, default=every,
                   help=f"steps between checkpoints (default {every})")  # fmt: skip
    p.add_argument(
        "--lookup",
        type=int,
        default=3,
        help="--eval: also walk with context copies of the last 1..N tokens (0: not)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    cfg = MTPTrainConfig(**{n: getattr(args, n) for n in FLAGS},
                         checkpoint_every=args.checkpoint_every)  # fmt: skip
    for name in ("depths", "steps", "batch", "draft_vocab", "checkpoint_every"):
        if getattr(cfg, name) < 1:
            raise ClpError(f"--{name.replace('_', '-')} must be 1 or more")
    if not 0 < cfg.lr < 1 or not 0 < cfg.decay <= 1 or cfg.mlp_size < 0 or cfg.warmup < 0:
        raise ClpError("--lr must be in (0, 1), --decay in (0, 1], --mlp-size and --warmup >= 0")
    if not 0 <= cfg.soft <= 1 or not 0 <= cfg.noise <= 1:
        raise ClpError("--soft and --noise must be in [0, 1]")
    if not 0 <= cfg.side_lr < 1 or (cfg.side_lr and not cfg.side):
        raise ClpError("--side-lr must be in [0, 1), and given only with --side")
    if cfg.pointer < 0 or not 0 <= cfg.pointer_lr < 1 or (cfg.pointer_lr and not cfg.pointer):
        raise ClpError("--pointer must be >= 0, --pointer-lr in [0, 1) and only with --pointer")
    if cfg.pointer_outside and not cfg.pointer:
        raise ClpError("--pointer-outside goes with --pointer")
    if cfg.pointer_only and not (cfg.pointer and cfg.init_from):
        raise ClpError("--pointer-only trains a copy head beside --init-from's layer: give both")
    if cfg.keep_vocab and not cfg.init_from:
        raise ClpError("--keep-vocab keeps the vocabulary of --init-from's drafter: give one")
    if not 0 <= args.lookup <= MAX_LOOKUP:
        raise ClpError(f"--lookup must be 0 to {MAX_LOOKUP}")
    _check_args(args, cfg)
    trainer = _trainer(args, cfg)
    out = Path(args.out)
    if args.eval:
        from ..train.mtp_trainer import to_bundle
        from ..train.rows_eval import score_folders

        if not trainer.restore(out):
            raise ClpError(f"no checkpoint of these flags in {out}")
        bundle = to_bundle(trainer)
        report = {"step": trainer.step, "config": asdict(cfg)}
        report["calibration"] = _calibrate(trainer, bundle, _held_rows(trainer, args.data))
        report.update(score_folders(trainer.model, bundle, args.data, args.lookup))
        print(json.dumps(report, indent=1))
        return 0
    held = _held_rows(trainer, args.data)
    started = time.perf_counter()
    resumed = _train(trainer, out, held, args.quiet)
    seconds = round(time.perf_counter() - started, 1)
    if resumed == cfg.steps and (out / "drafter" / "training.json").is_file():
        print(f"already trained: the drafter is in {out / 'drafter'}", file=sys.stderr)
        return 0  # its report keeps the run's own seconds
    words = argv if argv is not None else sys.argv[1:]
    timing = {"seconds": seconds, "resumed_at_step": resumed}
    _write_drafter(args, trainer, out / "drafter", " ".join([COMMAND, *words]), timing)
    print(f"drafter written to {out / 'drafter'}", file=sys.stderr)
    return 0


def _check_args(args, cfg: MTPTrainConfig) -> None:
    """What can be refused before the model loads: the seed, the depths
    against the drafts a step may hold and the data's continuations, --out."""
    from ..model.checks import seed
    from ..model.heads_checks import MAX_K
    from ..train.selfdistill_store import read_manifest

    seed(cfg.seed, "--seed")
    if cfg.depths > MAX_K:
        raise ClpError(f"--depths must be at most {MAX_K}")
    for d in map(Path, args.data):
        if not (d / "manifest.json").is_file():
            raise ClpError(f"not a self-distilled data folder (no manifest.json): {d}")
        settings = read_manifest(d).get("settings")
        new = settings.get("new_tokens") if isinstance(settings, dict) else None
        if isinstance(new, int) and cfg.depths >= new:
            raise ClpError(
                f"--depths {cfg.depths}: the rows of {d} continue for {new} tokens; "
                f"drafting from them, a depth past {new - 1} has no target"
            )
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ClpError(f"--out {args.out} is a file, not a folder")


def _write_drafter(args, trainer, folder: Path, command: str, timing: dict) -> None:
    """The drafter, with its report (``training.json``, as the heads' trainer
    writes: what ``convert heads-to-package`` ships) and curves."""
    import numpy as np

    from ..model.heads_files import save_heads
    from ..paths import write_text
    from ..train import selfdistill_store as store
    from ..train.fit import plot_history
    from ..train.mtp_trainer import to_bundle
    from ..train.rows_eval import score_folders

    bundle, rows = to_bundle(trainer, args.model or ""), trainer.rows
    greedy = rows.greedy_tokens()
    data = [store.describe(Path(d)) for d in args.data]
    held = [d for d, about in zip(args.data, data) if about["held_out_rows"]]
    held_rows = _held_rows(trainer, held)
    calibration = _calibrate(trainer, bundle, held_rows)
    baselines = _baselines(trainer, bundle, held_rows)
    report = {
        "command": command,
        "data": data,
        "train_rows": len(rows),
        "train_positions": rows.positions(trainer.cfg.prompt_targets),  # every target position
        "config": asdict(trainer.cfg),
        "draft_vocab_coverage": round(float(np.isin(greedy, trainer.vocab_ids).mean()), 4),
        **timing,  # "seconds": this run's training only
        "curve": trainer.curve(),
        "calibration": calibration,
        "baselines": baselines,
        "held_out": score_folders(trainer.model, bundle, held, args.lookup),
        "backbone_fingerprint": bundle.config.fingerprint,
    }
    save_heads(bundle, folder, force=True, extra={"curve": report["curve"]})
    plot_history(report["curve"], folder / "training.png", part="depth")
    write_text(folder / "training.json", json.dumps(report, indent=1) + "\n")


def _calibrate(trainer, bundle, rows) -> dict:
    """Fit ``bundle``'s temperatures on held-out ``rows`` (train/calibrate.py);
    {} where there are none."""
    from ..train.calibrate import calibrate

    return calibrate(trainer.model, bundle, rows) if len(rows) else {}


def _baselines(trainer, bundle, rows) -> dict:
    """The gate and head 0 baselines, fitted on held-out ``rows``
    (train/mtp_baselines.py); {} and none where there are none."""
    from ..train.mtp_baselines import fit_baselines

    return fit_baselines(trainer.model, bundle, rows) if len(rows) else {}


def _trainer(args, cfg: MTPTrainConfig):
    import mlx.core as mx

    from ..api import load_with_drafter
    from ..model.mtp_layer import MTPLayer
    from ..train.mtp_data import Rows
    from ..train.mtp_start import kept_vocab, start_from
    from ..train.mtp_trainer import MTPTrainer
    from ..train.trainer import draft_vocabulary

    model, _, _ = load_with_drafter(args.model, "none")
    rows = Rows.for_model(args.data, model.args)
    mx.random.seed(cfg.seed)  # the same start in every run of these flags
    if cfg.side and not rows.side_layers:
        raise ClpError("--side: --data keeps no earlier layers' states, or not the same in "
                       "every folder (distill --side-layers)")  # fmt: skip
    side = rows.side_layers if cfg.side else ()
    copy = {"pointer": cfg.pointer, "outside": cfg.pointer_outside}
    layer = MTPLayer(model.args, cfg.mlp_size, side_layers=side, **copy)
    kept = None
    if cfg.init_from:
        kept = start_from(layer, model, Path(cfg.init_from))
    else:
        layer.start_as_backbone(model.model.norm)
    if cfg.keep_vocab:
        ids = kept_vocab(kept, cfg)
    else:
        ids = draft_vocabulary(rows.greedy_tokens(), cfg.draft_vocab, model.args.vocab_size, kept)
    return MTPTrainer(model, layer, rows, cfg, ids)


HELD_ROWS = 32  # held-out rows checked at every checkpoint


def _held_rows(trainer, data: list[str]) -> list:
    """The data folders' held-out rows (none yet: [])."""
    from ..train.mtp_data import Rows
    from ..train.selfdistill_store import shard_folders

    if not any(shard_folders(Path(d), heldout=True) for d in data):
        return []
    return Rows.for_model(data, trainer.model.args, heldout=True)


def _train(trainer, out: Path, held, quiet: bool) -> int:
    """Train to the last step, from the checkpoint if any; the step it resumed at."""
    import numpy as np
    from tqdm import tqdm

    from ..train.fit import plot_history

    cfg = trainer.cfg
    resumed = trainer.step if trainer.restore(out) else 0
    if resumed:
        print(f"resuming at step {resumed}", file=sys.stderr)
    check = None
    if len(held):
        check = trainer.batch(np.arange(min(HELD_ROWS, len(held))), held)
    bar = tqdm(total=cfg.steps, initial=trainer.step, disable=quiet, desc="MTP layer")
    while trainer.step < cfg.steps:
        loss, acc = trainer.train_step()
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", acc="/".join(f"{a:.2f}" for a in acc))
        if trainer.step % cfg.checkpoint_every == 0 or trainer.step == cfg.steps:
            if check is not None:
                trainer.history[-1]["held"] = trainer.held_accuracy(check)
            trainer.save(out)
            plot_history(trainer.curve(), out / "curves.png", part="depth")
    bar.close()
    return resumed


if __name__ == "__main__":
    run(main)
