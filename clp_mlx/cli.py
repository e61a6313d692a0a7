"""What every command-line entry point shares: how errors reach the user."""

from __future__ import annotations

import sys
from typing import Callable

from .errors import ClpError


def run(main: Callable[[], int | None]) -> None:
    """Run ``main``; a user error prints one line and exits 1, Ctrl-C exits 130."""
    try:
        code = main()
    except ClpError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
