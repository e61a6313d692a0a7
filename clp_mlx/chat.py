"""``python -m clp_mlx.chat``: the command lives in :mod:`clp_mlx.cli.chat`."""

if __name__ == "__main__":  # importing this module must not shadow clp_mlx.chat()
    from .cli.chat import cli

    cli()
