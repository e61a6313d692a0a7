"""Convert a Hugging Face Qwen2 folder (safetensors or pytorch_model*.bin) into an MLX model folder.

Example::

    python convert/hf_to_mlx.py Qwen2.5-0.5B-Instruct -o qwen05-mlx
    python convert/hf_to_mlx.py Qwen2.5-7B-Instruct -o qwen7b-4bit -q 4

``.bin`` checkpoints are read without torch and without running their pickled code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Let the script run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clp_mlx.cli.args import add_model_output_args, guarded  # noqa: E402
from clp_mlx.sources.hf import DTYPES, Q_BITS, Q_GROUP_SIZES, convert_hf  # noqa: E402


def setup_arg_parser() -> argparse.ArgumentParser:
    """The command-line options of the converter."""
    parser = argparse.ArgumentParser(
        description="Convert a Hugging Face Qwen2 folder into an MLX model folder (config, safetensors, tokenizer)."
    )
    parser.add_argument("src", help="Hugging Face model folder (config.json, tokenizer, weights)")
    add_model_output_args(parser, DTYPES, Q_BITS, Q_GROUP_SIZES)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the converter; returns the process exit status."""
    args = setup_arg_parser().parse_args(argv)

    def convert() -> None:
        out = convert_hf(
            args.src,
            args.out,
            dtype=args.dtype,
            q_bits=args.q_bits,
            q_group_size=args.q_group_size,
            force=args.force,
        )
        print(f"wrote {out}")

    return guarded(convert)


if __name__ == "__main__":
    sys.exit(main())
