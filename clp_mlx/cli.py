"""What every command-line entry point shares: how errors reach the user."""

from __future__ import annotations

import sys
from typing import Callable

from .errors import ClpError


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
