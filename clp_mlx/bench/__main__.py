"""``python -m clp_mlx.bench``: the command lives in :mod:`clp_mlx.cli.bench`."""

from ..cli.bench import cli

cli()
