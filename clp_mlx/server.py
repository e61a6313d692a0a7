"""``python -m clp_mlx.server``: the command lives in :mod:`clp_mlx.cli.server`."""

if __name__ == "__main__":
    from .cli.server import cli

    cli()
