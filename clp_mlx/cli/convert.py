"""``python -m clp_mlx.cli.convert``: converters into MLX models and clp-mlx heads.

    python -m clp_mlx.cli.convert gguf qwen2.5-0.5b-instruct-q4_k_m.gguf -o qwen05-mlx [-q 4]
    python -m clp_mlx.cli.convert hf Qwen2.5-7B-Instruct -o qwen7b-4bit [-q 4]
    python -m clp_mlx.cli.convert heads-from-torch medusa_lm_head.pt --model qwen05-mlx -o heads
    python -m clp_mlx.cli.convert heads-to-package my-heads qwen2.5-coder-0.5b-instruct
    python -m clp_mlx.cli.convert heads-from-eagle pytorch_model.bin --model qwen7b -o drafter
    python -m clp_mlx.cli.convert grow-vocab drafter --model M -o drafter32k --size 32768 --text wiki.train.raw

``.bin``/``.pt`` checkpoints are read without torch and without running their
pickled code. The scripts in ``convert/`` run these subcommands.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from ..errors import ClpError
from ..model.heads_files import read_config
from ..sources import gguf, hf
from ..sources.packaging import package_heads
from ..sources.torch_heads import convert_torch_heads
from .args import add_debug, add_model_output_args, guarded, parser, run

PROG = "python -m clp_mlx.cli.convert"
MLX_FOLDER = "an MLX model folder (config, safetensors, tokenizer)"


def _model_options(args) -> dict:
    """What :func:`add_model_output_args` adds, but ``-o``: the model converters' keywords."""
    names = ("dtype", "q_bits", "q_group_size", "force")
    return {name: getattr(args, name) for name in names}


def _gguf(args) -> None:
    out = gguf.convert_gguf(
        args.gguf, args.out, progress=not args.no_progress, **_model_options(args)
    )
    print(f"wrote {out}")


def _hf(args) -> None:
    print(f"wrote {hf.convert_hf(args.src, args.out, **_model_options(args))}")


def _heads_from_torch(args) -> None:
    out = convert_torch_heads(
        args.checkpoint,
        args.model,
        args.out,
        force=args.force,
        drop_head_projections=args.drop_head_projections,
    )
    print(f"wrote {out}")


def _heads_from_eagle(args) -> None:
    from ..api import load_with_drafter
    from ..model import heads_checks
    from ..sources.eagle_heads import convert_eagle

    if not 1 <= args.k <= heads_checks.MAX_K:
        raise ClpError(f"--k must be in 1..{heads_checks.MAX_K}, got {args.k}")
    model, _, _ = load_with_drafter(args.model, "none")
    print(f"wrote {convert_eagle(args.checkpoint, model, args.out, k=args.k, force=args.force)}")


def _heads_to_package(args) -> None:
    dest = package_heads(args.heads, args.model)
    config = read_config(dest)
    summary = {"k": config.k, "design": config.design, "fingerprint": config.fingerprint}
    print(json.dumps({"shipped": str(dest), **summary}))


def _grow_vocab(args) -> None:
    from ..api import load_with_drafter
    from ..train.vocab_grow import check_request, grow_vocab

    check_request(args.drafter, args.out, texts=args.text, data=args.data, force=args.force)
    model, tokenizer, _ = load_with_drafter(args.model, "none")
    out = grow_vocab(args.drafter, model, tokenizer, args.out, args.size, texts=args.text,
                     data=args.data, force=args.force)  # fmt: skip
    print(f"wrote {out}")


def _add(commands, name: str, action: Callable, description: str) -> argparse.ArgumentParser:
    p = commands.add_parser(name, help=description, description=description)
    add_debug(p)  # after the subcommand too: "convert gguf F --debug"
    p.set_defaults(run=action)
    return p


def setup_arg_parser() -> argparse.ArgumentParser:
    """The converters' options, a subcommand each."""
    top = parser(PROG, __doc__.splitlines()[0])
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = _add(commands, "gguf", _gguf, f"Convert a Qwen2 GGUF file into {MLX_FOLDER}.")
    p.add_argument("gguf", help="path to the .gguf file")
    add_model_output_args(p, gguf.DTYPES, gguf.Q_BITS, gguf.Q_GROUP_SIZES)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p = _add(commands, "hf", _hf, f"Convert a Hugging Face Qwen2 folder into {MLX_FOLDER}.")
    p.add_argument("src", help="Hugging Face model folder (config.json, tokenizer, weights)")
    add_model_output_args(p, hf.DTYPES, hf.Q_BITS, hf.Q_GROUP_SIZES)
    about = "Convert a PyTorch head checkpoint into clp-mlx heads."
    p = _add(commands, "heads-from-torch", _heads_from_torch, about)
    p.add_argument("checkpoint", help="head checkpoint: .pt/.bin (torch zip) or .safetensors")
    p.add_argument("--model", required=True, help="the MLX model folder the heads are for")
    p.add_argument(
        "-o", "--out", required=True, help="heads folder to write (must not exist unless --force)"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace the heads folder if it exists and holds only heads",
    )
    p.add_argument(
        "--drop-head-projections",
        action="store_true",
        help="drop per-head output projections even when they differ from the backbone's",
    )
    about = "Convert an EAGLE-1/2 draft head (one decoder layer) into an MTP-layer drafter."
    p = _add(commands, "heads-from-eagle", _heads_from_eagle, about)
    p.add_argument(
        "checkpoint", help="EAGLE head: pytorch_model.bin/.pt (torch zip) or .safetensors"
    )
    p.add_argument("--model", required=True, help="the backbone it was trained for")
    p.add_argument("-o", "--out", required=True, help="drafter folder to write")
    p.add_argument("--k", type=int, default=4, help="drafts per step (default: 4)")
    p.add_argument("--force", action="store_true", help="replace --out if it holds only a drafter")
    about = "Grow a drafter's draft vocabulary by the most frequent tokens of texts and rows."
    p = _add(commands, "grow-vocab", _grow_vocab, about)
    p.add_argument("drafter", help="an MTP-layer drafter folder with a draft vocabulary")
    p.add_argument("--model", required=True, help="the backbone it drafts for")
    p.add_argument("-o", "--out", required=True, help="drafter folder to write")
    p.add_argument("--size", type=int, required=True, help="ids in the grown draft vocabulary")
    p.add_argument("--text", nargs="+", default=[], help="UTF-8 text files to count tokens in")
    p.add_argument("--data", nargs="+", default=[], help="distilled folders: their greedy tokens")
    p.add_argument("--force", action="store_true", help="replace --out if it holds only a drafter")
    about = "Package trained heads so that the matching default model finds them."
    p = _add(commands, "heads-to-package", _heads_to_package, about)
    p.add_argument("heads", help="a trained heads folder (python -m clp_mlx.train --out ...)")
    p.add_argument("model", help="the named default model these heads belong to")
    return top


def main(argv: list[str] | None = None) -> int:
    """Run one converter; returns the process exit status."""
    args = setup_arg_parser().parse_args(argv)
    return guarded(lambda: args.run(args), argv)


def subcommand(name: str) -> Callable[[list[str] | None], int]:
    """``main`` of the one subcommand ``name``: what the scripts in ``convert/`` run."""

    def run(argv: list[str] | None = None) -> int:
        return main([name, *(sys.argv[1:] if argv is None else argv)])

    return run


def cli() -> None:
    run(main)  # main guards its own errors; run also fills closed standard descriptors


if __name__ == "__main__":
    cli()
