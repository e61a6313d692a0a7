"""``python -m clp_mlx.train``: the command lives in :mod:`clp_mlx.cli.train`."""

from ..cli.train import cli

cli()
