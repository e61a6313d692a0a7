"""Which OpenBLAS kernels the preload chooses (clp_mlx/native/blas.py).

An OpenBLAS older than the CPU falls back to SSE3 kernels unless
``OPENBLAS_CORETYPE`` names better ones; the preload sets it from the CPU's
flags, and leaves a value the user set alone.
"""

import os
import platform
import subprocess
import sys

import pytest

from clp_mlx.native import few_rows, status
from clp_mlx.native.blas import core_for

AVX512 = {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}


def test_the_core_follows_the_widest_vectors_the_cpu_has():
    assert core_for(AVX512 | {"avx2", "fma", "sse3"}) == "SkylakeX"
    assert core_for({"avx512f", "avx2", "fma"}) == "Haswell"  # AVX-512 without BW/DQ/VL (Knights)
    assert core_for({"avx2", "fma", "sse4_2"}) == "Haswell"
    assert core_for({"avx", "sse4_2"}) is None  # OpenBLAS's own choice
    assert core_for(set()) is None


def _core_in_child(coretype: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    if coretype is not None:
        env["OPENBLAS_CORETYPE"] = coretype
    code = "import clp_mlx\nfrom clp_mlx.native import status\nprint(status().core)\n"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


needs_x86_openblas = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64" or status().core is None,
    reason="the core choice is for OpenBLAS on x86-64 Linux",
)


@needs_x86_openblas
def test_openblas_loads_the_kernels_the_cpu_flags_name():
    want = core_for(few_rows.cpu_flags())
    if want is None:
        pytest.skip("this CPU has no AVX2: OpenBLAS chooses")
    assert _core_in_child(None).lower() == want.lower()


@needs_x86_openblas
def test_a_core_type_the_user_set_is_kept():
    assert _core_in_child("Haswell").lower() == "haswell"
