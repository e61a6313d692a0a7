"""``mlx_lm.sample_utils``'s sampler factory, for code written against mlx-lm:
``from clp_mlx.sample_utils import make_sampler``. Its samplers keep
``verify`` exact (see :func:`clp_mlx.decode.sampling.make_sampler`)."""

from .decode.sampling import make_sampler

__all__ = ["make_sampler"]
