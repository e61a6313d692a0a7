"""The few-row sgemm kernel (clp_mlx/few_rows.c) that MLX's CPU matmuls reach.

In this process it is loaded by ``import clp_mlx`` (conftest) when a C compiler
is present, so the whole suite decodes through it; these tests check its
arithmetic against float64 references, that a row's result does not depend on
how many rows share the call, and that a machine without a compiler falls
back to plain OpenBLAS.
"""

import ctypes
import os
import platform
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from clp_mlx.native import few_rows as _few_rows
from clp_mlx.native import status

needs_kernel = pytest.mark.skipif(
    not status().few_rows, reason=f"few-row kernel not in use here: {status().note}"
)
# The kernel's own cblas_sgemm, called directly: loaded is enough, MLX may bind another.
needs_library = pytest.mark.skipif(
    _few_rows.library() is None, reason=f"few-row kernel not loaded here: {status().note}"
)


def _ref(a, b):
    return np.asarray(a, dtype=np.float64) @ np.asarray(b, dtype=np.float64)


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16])  # every tile size
@pytest.mark.parametrize("n,k", [(1, 1), (3, 7), (7, 9), (301, 64), (600, 520)])
def test_products_match_float64(m, n, k):
    mx.random.seed(m * 1000 + n + k)
    x, w = mx.random.normal((m, k)), mx.random.normal((n, k))
    v, bias = mx.random.normal((k, n)), mx.random.normal((n,))
    before = _few_rows.served()
    got = {
        "x w^T": (x @ w.T, _ref(x, np.asarray(w).T)),
        "x v": (x @ v, _ref(x, v)),
        "bias + 0.5 x w^T": (
            mx.addmm(bias, x, w.T, alpha=0.5),
            np.asarray(bias, dtype=np.float64) + 0.5 * _ref(x, np.asarray(w).T),
        ),
    }
    mx.eval([y for y, _ in got.values()])
    assert _few_rows.served() > before  # the kernel answered, not OpenBLAS
    for name, (y, want) in got.items():
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4 * np.sqrt(k), err_msg=name)


@needs_kernel
@pytest.mark.parametrize("transposed", [True, False])
def test_a_row_gets_the_same_bits_whatever_rows_share_the_call(transposed):
    mx.random.seed(7)
    x = mx.random.normal((16, 520))  # up to 16 rows: tiles of 1-8 rows, split evenly
    w = mx.random.normal((600, 520)) if transposed else mx.random.normal((520, 600))

    def mul(rows):
        return rows @ w.T if transposed else rows @ w

    whole = np.asarray(mul(x))
    few = [(0, 1), (3, 4), (1, 3), (2, 7), (6, 7)]
    more = [(0, 5), (0, 6), (1, 8), (0, 8), (0, 9), (3, 16)]  # one tile of 5-8, then two
    for lo, hi in few + more:
        assert np.array_equal(np.asarray(mul(x[lo:hi])), whole[lo:hi]), (lo, hi)


@needs_kernel
def test_many_rows_and_transposed_operands_go_to_openblas_and_stay_right():
    mx.random.seed(3)
    a, w = mx.random.normal((300, 200)), mx.random.normal((500, 200))
    at = mx.random.normal((200, 40))  # used transposed: (40 x 200)
    for y, want in [(a @ w.T, _ref(a, np.asarray(w).T)), (at.T @ w.T, _ref(np.asarray(at).T, np.asarray(w).T))]:
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=2e-3)



@needs_kernel
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="flushing is x86 only")
@pytest.mark.parametrize("rows,cols", [(40, 256), (300, 2048)])  # one OpenBLAS call; split by ours
def test_what_goes_to_openblas_flushes_subnormals_and_only_there(rows, cols):
    """A subnormal operand counts as zero in a product OpenBLAS does (on x86 it
    would take a slow path: 100x on a whole operand), and elementwise
    arithmetic after the call keeps IEEE subnormals (the MXCSR restored)."""
    tiny = mx.full((rows, 256), 1e-39)  # subnormal in float32
    mx.eval(tiny)
    out = np.asarray(tiny @ mx.ones((256, cols)))
    assert (out == 0).all()  # without the flush: 256e-39, a normal float
    after = np.asarray(tiny[:1, :4] * 1.0)
    assert (after > 0).all() and (after < np.finfo(np.float32).tiny).all()

def _child(env_extra: dict, tmp_path) -> str:
    code = (
        "import clp_mlx, numpy as np, mlx.core as mx\n"
        "from clp_mlx.native import status\n"
        "x, w = mx.ones((2, 64)), mx.ones((3, 64))\n"
        "assert np.allclose(np.asarray(x @ w.T), 64.0)\n"
        "print(status().few_rows, status().note)\n"
    )
    env = {**os.environ, "CLP_MLX_HOME": str(tmp_path), **env_extra}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(sys.platform != "linux" or not status().loaded, reason="OpenBLAS preload is Linux-only")
def test_without_a_compiler_or_when_off_plain_openblas_does_the_work(tmp_path):
    assert _child({"CC": str(tmp_path / "no-such-cc")}, tmp_path).startswith("False off (could not build")
    assert _child({"CLP_MLX_FEW_ROWS": "0"}, tmp_path) == "False off (CLP_MLX_FEW_ROWS=0)"
    assert not (tmp_path / "few_rows").exists() or not any((tmp_path / "few_rows").iterdir())


def _sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, order=101, lib=None):
    """The kernel's cblas_sgemm (``lib``'s, or the loaded one's) called directly
    (row-major unless ``order``) on float32 numpy buffers."""
    f = (lib or _few_rows.library()).cblas_sgemm
    ptr = ctypes.POINTER(ctypes.c_float)
    f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ptr, ctypes.c_int, ptr, ctypes.c_int]
    f.argtypes += [ctypes.c_float, ptr, ctypes.c_int]
    as_ptr = lambda x: x.ctypes.data_as(ptr)  # noqa: E731
    f(order, ta, tb, m, n, k, alpha, as_ptr(a), lda, as_ptr(b), ldb, beta, as_ptr(c), ldc)


@needs_library
@pytest.mark.parametrize("m", [1, 3, 16, 64])
@pytest.mark.parametrize("tb", [111, 112, 113])
def test_the_cblas_contract_strides_alpha_beta(m, tb):
    rng = np.random.default_rng(m + tb)
    n, k, pad = 300, 260, 5  # padded rows: lda, ldb, ldc wider than the matrices
    a = rng.standard_normal((m, k + pad), dtype=np.float32)
    b_rows, b_cols = (k, n) if tb == 111 else (n, k)
    b = rng.standard_normal((b_rows, b_cols + pad), dtype=np.float32)
    op_b = b[:, :b_cols] if tb == 111 else b[:, :b_cols].T
    for alpha, beta in [(1.0, 0.0), (0.5, 2.0), (0.0, 3.0)]:
        c = np.full((m, n + pad), np.nan if beta == 0 else 1.5, dtype=np.float32)
        if alpha == 0:
            a[0, 0] = np.inf  # alpha 0: A and B are not to be read
        want = alpha * _ref(a[:, :k], op_b) if alpha else 0.0
        want = want + (beta * c[:, :n].astype(np.float64) if beta else 0.0)
        margin = c[:, n:].copy()
        _sgemm(111, tb, m, n, k, alpha, a, k + pad, b, b_cols + pad, beta, c, n + pad)
        np.testing.assert_allclose(c[:, :n], want, rtol=1e-4, atol=1e-3, err_msg=f"{alpha} {beta}")
        assert np.array_equal(c[:, n:], margin, equal_nan=True)  # ldc's margin untouched
        a[0, 0] = 0.0


@needs_library
@pytest.mark.parametrize("m", [1, 64])
def test_the_contract_edges_are_the_kernels_not_the_fallbacks(m):
    """K = 0, no rows or columns, column-major with beta 0 over NaN: answered by
    the kernel's own rules, whatever the BLAS behind it does with them."""
    rng = np.random.default_rng(m)
    n, k = 40, 24
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((n, k), dtype=np.float32)
    c = np.full((m, n), 2.0, dtype=np.float32)
    _sgemm(111, 112, m, n, 0, 1.0, a, k, b, k, 0.5, c, n)  # K = 0: C = beta C
    assert np.array_equal(c, np.full((m, n), 1.0, dtype=np.float32))
    for rows, cols in [(0, n), (m, 0)]:
        c = np.full((m, n), np.nan, dtype=np.float32)
        _sgemm(111, 112, rows, cols, k, 1.0, a, k, b, k, 0.0, c, n)
        assert np.isnan(c).all()  # nothing to compute: C untouched
    # column-major C = A B^T: A is (m x k) with lda = m, stored as k columns of m.
    cm = np.full((n, m), np.nan, dtype=np.float32)  # n columns of m
    _sgemm(111, 112, m, n, k, 1.0, np.ascontiguousarray(a.T), m, np.ascontiguousarray(b.T), n,
           0.0, cm, m, order=102)
    np.testing.assert_allclose(cm.T, _ref(a, b.T), rtol=1e-4, atol=1e-4)


def test_the_status_tells_whether_mlx_reaches_the_kernel():
    """few_rows is True exactly when a product through MLX is answered by the kernel."""
    before = _few_rows.served()
    mx.eval(mx.ones((2, 64)) @ mx.ones((3, 64)).T)
    assert (_few_rows.served() > before) == status().few_rows, status().note


@pytest.mark.parametrize(
    "flags,wanted",
    [
        ("sse2", []),
        ("avx2 fma", ["-mavx2", "-mfma"]),
        (
            "avx2 fma avx512f avx512vl",
            ["-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-DTILE_ROWS=8", "-DLANES=16"],
        ),
        ("avx2 avx512f avx512vl", []),  # no FMA: none of it
    ],
)
def test_the_build_asks_for_what_the_cpu_has(flags, wanted):
    """AVX-512VL's registers (the 8-row tile) and vectors of 16 floats only on
    a CPU with AVX2, FMA and AVX-512VL."""
    got = _few_rows._flags(f"model name\t: some cpu\nflags\t\t: fpu {flags} ht")
    assert got == _few_rows.FLAGS + wanted


@needs_library
@pytest.mark.parametrize("cpu", ["sse2", "avx2 fma", "avx2 fma avx512f avx512vl"])
def test_every_build_a_cpu_can_get_computes_the_same_products(cpu, tmp_path, monkeypatch):
    """The kernel as built for a plainer CPU (vectors of 8 floats, tiles of 4
    rows) or an AVX-512 one (16 floats, 8 rows) is right, leftovers of K
    included, and a row's bits do not depend on how many rows share the call."""
    if not set(cpu.split()) <= _few_rows.cpu_flags() | {"sse2"}:
        pytest.skip(f"this CPU cannot run a build for {cpu!r}")
    monkeypatch.setattr(_few_rows, "cpu_info", lambda: f"flags\t\t: {cpu}")  # built as for it
    lib = ctypes.CDLL(str(_few_rows.build(tmp_path)))  # its own cblas_sgemm, beside the loaded one
    lib.few_rows_init(ctypes.cast(_few_rows.library().cblas_sgemm, ctypes.c_void_p))
    rng = np.random.default_rng(len(cpu))
    n, k = 37, 1003  # K: 62 vectors of 16 and 11 left over, or 125 of 8 and 3
    a = rng.standard_normal((9, k), dtype=np.float32)
    b = rng.standard_normal((n, k), dtype=np.float32)
    rows = {}
    for m in range(1, 10):
        c = np.zeros((m, n), dtype=np.float32)
        _sgemm(111, 112, m, n, k, 1.0, a, k, b, k, 0.0, c, n, lib=lib)
        np.testing.assert_allclose(c, _ref(a[:m], b.T), rtol=1e-4, atol=1e-3, err_msg=str(m))
        rows[m] = c
    for m in range(1, 10):
        assert np.array_equal(rows[m], rows[9][:m]), m
