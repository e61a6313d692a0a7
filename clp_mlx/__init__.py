"""clp-mlx: Backbone-as-Architect multi-token decoding for Qwen2.5 on MLX."""

from .native.blas import preload_openblas

preload_openblas()  # must precede the first ``import mlx.core`` in the process

from .api import generate, load, stream_generate  # noqa: E402

__all__ = ["generate", "load", "stream_generate"]
__version__ = "0.1.0"
