"""clp-mlx: Backbone-as-Architect multi-token decoding for Qwen2.5 on MLX."""

from ._blas import preload_openblas

preload_openblas()  # must precede the first ``import mlx.core`` in the process

__all__ = ["generate", "load", "stream_generate"]
__version__ = "0.1.0"


def __getattr__(name):
    # Imported on first use so that `import clp_mlx.sources` (or a converter)
    # does not pay for loading mlx-lm's generation stack.
    if name in __all__:
        from . import generate as _gen

        return getattr(_gen, name)
    raise AttributeError(name)
