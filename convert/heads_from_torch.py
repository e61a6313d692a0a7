"""Convert PyTorch head checkpoints (Medusa's medusa_lm_head.pt, or clp-mlx key names) into clp-mlx heads.

Example::

    python convert/heads_from_torch.py medusa_lm_head.pt --model qwen7b-mlx -o qwen7b-medusa-heads

Medusa heads carry their own copy of the output projection; it is checked
against the backbone's and dropped (clp-mlx heads share the backbone's).
``--drop-head-projections`` drops it even when it differs, with a warning.
The checkpoint is read without torch and without running its pickled code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Let the script run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clp_mlx.cli.args import guarded  # noqa: E402
from clp_mlx.sources.torch_heads import convert_torch_heads  # noqa: E402


def setup_arg_parser() -> argparse.ArgumentParser:
    """The command-line options of the converter."""
    parser = argparse.ArgumentParser(
        description="Convert a PyTorch head checkpoint into clp-mlx heads."
    )
    parser.add_argument("checkpoint", help="head checkpoint: .pt/.bin (torch zip) or .safetensors")
    parser.add_argument("--model", required=True, help="the MLX model folder the heads are for")
    parser.add_argument(
        "-o", "--out", required=True, help="heads folder to write (must not exist unless --force)"
    )
    parser.add_argument(
        "--force", action="store_true", help="replace the heads folder if it exists"
    )
    parser.add_argument(
        "--drop-head-projections",
        action="store_true",
        help="drop per-head output projections even when they differ from the backbone's",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the converter; returns the process exit status."""
    args = setup_arg_parser().parse_args(argv)

    def convert() -> None:
        out = convert_torch_heads(
            args.checkpoint,
            args.model,
            args.out,
            force=args.force,
            drop_head_projections=args.drop_head_projections,
        )
        print(f"wrote {out}")

    return guarded(convert)


if __name__ == "__main__":
    sys.exit(main())
