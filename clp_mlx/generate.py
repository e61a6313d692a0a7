"""``python -m clp_mlx.generate``: the command lives in :mod:`clp_mlx.cli.generate`."""

if __name__ == "__main__":  # importing this module must not shadow clp_mlx.generate()
    from .cli.generate import cli

    cli()
