"""What every command-line entry point shares: how errors reach the user."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from ..errors import ClpError


def guarded(main: Callable[[], int | None]) -> int:
    """Run ``main``; a user error prints one line and gives 1, Ctrl-C gives 130."""
    try:
        return main() or 0
    except ClpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def run(main: Callable[[], int | None]) -> None:
    """Run a command's ``main`` and exit with its status (see :func:`guarded`)."""
    sys.exit(guarded(main))


def add_model_output_args(
    parser: argparse.ArgumentParser,
    dtypes: Sequence[str],
    q_bits: Sequence[int],
    group_sizes: Sequence[int],
) -> None:
    """-o/--out, --dtype, -q/--q-bits, --q-group-size, --force: what model converters share."""
    parser.add_argument(
        "-o", "--out", required=True, help="output folder (must not exist unless --force)"
    )
    parser.add_argument(
        "--dtype",
        choices=list(dtypes),
        default="float16",
        help="dtype of the written weights (default: float16)",
    )
    parser.add_argument(
        "-q",
        "--q-bits",
        type=int,
        choices=q_bits,
        default=None,
        help="quantize with MLX to this many bits",
    )
    parser.add_argument(
        "--q-group-size",
        type=int,
        choices=group_sizes,
        default=64,
        help="MLX quantization group size (default: 64)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace the output folder if it exists"
    )
