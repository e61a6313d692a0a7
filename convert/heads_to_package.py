"""Runs ``python -m clp_mlx.cli.convert heads-to-package ARGS`` from a checkout (and old docs)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package, not installed
from clp_mlx.cli.convert import subcommand  # noqa: E402

main = subcommand("heads-to-package")
if __name__ == "__main__":
    sys.exit(main())
