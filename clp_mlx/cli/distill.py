"""``python -m clp_mlx.cli.distill``: self-distilled training data for a drafter.

    python -m clp_mlx.cli.distill --model qwen2.5-coder-0.5b-instruct --out data/05b-wiki \\
        --kind wikitext --data path/to/wikitext-2-raw/wiki.train.raw --prompts 3500

Writes the backbone's greedy continuations of prompts with its final hidden
state at every position, in checksummed shards (see docs/DATA.md and
:mod:`clp_mlx.train.selfdistill`). Run it again with the same arguments to
resume: whole shards are kept, the rest made again. ``--shard i/n`` (or the
ranks of ``mlx.launch``) splits the shards between processes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import ClpError
from ..model.backbone import DTYPES
from ..model.checks import seed
from ..train.selfdistill import KINDS
from .args import parser, run


def parse(argv=None) -> argparse.Namespace:
    p = parser(
        "python -m clp_mlx.cli.distill",
        "Write the backbone's greedy continuations and hidden states, resumably.",
    )
    p.add_argument(
        "--model", default=None, help="named model or MLX/HF folder (default: the default model)"
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 on CPU")
    p.add_argument("--out", required=True, help="the data folder (made, or resumed)")
    p.add_argument("--kind", choices=KINDS, required=True)
    p.add_argument(
        "--data",
        nargs="+",
        default=[],
        help="wikitext: text files; code: .py files or folders (walked for *.py); "
        "magpie: data folders whose questions to answer (default: sample new ones); "
        "sampled: none",
    )
    p.add_argument(
        "--start",
        default="",
        help="sampled: the text every opening is sampled after, e.g. "
        "$'From Wikipedia, the free encyclopedia\\n\\n'",
    )
    p.add_argument("--prompts", type=int, required=True, help="prompt indices (rows) to make")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=32,
        help="tokens per prompt; magpie, sampled: the cap on what is sampled (default: 32)",
    )
    p.add_argument("--new-tokens", type=int, default=96, help="greedy tokens per row (default: 96)")
    p.add_argument("--batch", type=int, default=16, help="rows decoded together (default: 16)")
    p.add_argument("--shard-size", type=int, default=128, help="prompts per shard (default: 128)")
    p.add_argument("--shard", default=None, help="i/n: make only the shards j with j %% n == i")
    p.add_argument(
        "--heldout", type=float, default=0.02, help="share of prompts held out (default: 0.02; 1: all, for evaluation only)"
    )
    p.add_argument("--seed", type=int, default=0, help="prompt order; magpie's and sampled's draws")
    p.add_argument(
        "--side-layers", type=int, nargs="+", default=[], metavar="N",
        help="also keep the states after the first N layers, for each N (EAGLE-3's "
        "low and middle features, e.g. 2 12 on a 24-layer model; default: none)",
    )  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def split_of(spec: str | None) -> tuple[int, int]:
    """(i, n) from ``--shard i/n``, or from the ranks of ``mlx.launch``."""
    import mlx.core as mx

    group = mx.distributed.init() if mx.distributed.is_available() else None
    if group is not None and group.size() > 1:
        if spec is not None:
            raise ClpError("give --shard or run under mlx.launch, not both: each splits the work")
        return group.rank(), group.size()
    if spec is None:
        return 0, 1
    try:
        i, n = (int(v) for v in spec.split("/"))
    except ValueError:
        raise ClpError(f"--shard takes i/n (e.g. 0/2), got {spec!r}") from None
    if not 0 <= i < n:
        raise ClpError(f"--shard {spec}: i must be in 0..n-1")
    return i, n


def main(argv=None) -> int:
    args = parse(argv)
    seed(args.seed, "--seed")
    from ..model import backbone
    from ..sources.resolve import resolve_model
    from ..train import selfdistill_store as store
    from ..train.selfdistill import Settings, distill

    part = split_of(args.shard)
    dtype = args.dtype or backbone.default_dtype()
    settings = Settings(
        kind=args.kind,
        prompts=args.prompts,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        batch=args.batch,
        shard_size=args.shard_size,
        heldout=args.heldout,
        seed=args.seed,
        dtype=dtype,
        side_layers=tuple(args.side_layers),
        start=args.start,
    )
    model, tokenizer = backbone.load_backbone(resolve_model(args.model, dtype=dtype), dtype)
    sources = {"model": args.model, "data": args.data}
    done = distill(
        model, tokenizer, args.out, settings, args.data, part=part, progress=not args.quiet, sources=sources
    )
    print(
        f"{args.out}: shards {part[0]}/{part[1]}: {done['whole']} of {done['mine']} whole "
        f"({done['made']} made now, {done['busy']} held by another process)"
    )
    t = store.totals(Path(args.out)) if done["whole"] == done["mine"] else None
    if t is not None and t["shards"] == done["shards"]:
        print(
            f"{args.out}: complete: {t['shard']} training rows from {t['distinct']} distinct "
            f"prompts, {t['heldout']} held out, {t['positions']} positions"
        )
    return 0 if done["whole"] == done["mine"] else 3


def cli() -> None:
    run(main)


if __name__ == "__main__":
    cli()
