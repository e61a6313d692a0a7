"""Convert a Qwen2 GGUF file (llama.cpp) into an MLX model folder.

Example::

    python convert/gguf_to_mlx.py qwen2.5-0.5b-instruct-q4_k_m.gguf -o qwen05-mlx
    python convert/gguf_to_mlx.py model.gguf -o model-4bit -q 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Let the script run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clp_mlx.cli.args import add_model_output_args, guarded
from clp_mlx.sources.gguf import DTYPES, Q_BITS, Q_GROUP_SIZES, convert_gguf


def setup_arg_parser() -> argparse.ArgumentParser:
    """The command-line options of the converter."""
    parser = argparse.ArgumentParser(
        description="Convert a Qwen2 GGUF file into an MLX model folder (config, safetensors, tokenizer)."
    )
    parser.add_argument("gguf", help="path to the .gguf file")
    add_model_output_args(parser, DTYPES, Q_BITS, Q_GROUP_SIZES)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the converter; returns the process exit status."""
    args = setup_arg_parser().parse_args(argv)

    def convert() -> None:
        out = convert_gguf(
            args.gguf,
            args.out,
            dtype=args.dtype,
            q_bits=args.q_bits,
            q_group_size=args.q_group_size,
            force=args.force,
            progress=not args.no_progress,
        )
        print(f"wrote {out}")

    return guarded(convert)


if __name__ == "__main__":
    sys.exit(main())
