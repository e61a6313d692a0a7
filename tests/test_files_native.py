"""The few-row kernel is loaded only from files no one else could have written,
and the status says whether it really answers MLX's sgemm calls."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clp_mlx.native import few_rows, status

REPO = Path(__file__).resolve().parents[1]
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")
needs_openblas = pytest.mark.skipif(
    sys.platform != "linux" or not status().loaded, reason="OpenBLAS preload is Linux-only"
)
needs_compiler = pytest.mark.skipif(few_rows.library() is None, reason=f"kernel not built here: {status().note}")

_REPORT = (
    "import clp_mlx, mlx.core as mx\n"
    "from clp_mlx.native import few_rows, status\n"
    "before = few_rows.served()\n"
    "mx.eval(mx.ones((2, 64)) @ mx.ones((3, 64)).T)\n"
    "print(status().few_rows, few_rows.served() > before, status().note)\n"
)


def _child(home: Path, **env: str) -> str:
    # A fresh process as a user starts one: a preloaded BLAS (this run's own
    # LD_PRELOAD) would shadow the kernel whose loading these tests are about.
    parent = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    full = {**parent, "CLP_MLX_HOME": str(home), **env}
    done = subprocess.run([sys.executable, "-c", _REPORT], env=full, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _plant(home: Path, marker: Path) -> Path:
    """A library under the kernel's cached name whose loading creates ``marker``."""
    real = few_rows.build(home)
    src = home / "evil.c"
    src.write_text('#include <fcntl.h>\n__attribute__((constructor)) static void f(void) '
                   f'{{ creat("{marker}", 0644); }}\n')
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(real), str(src)], check=True)
    return real


@needs_openblas
@pytest.mark.skipif(not OPENBLAS.exists(), reason="no system OpenBLAS to preload")
def test_a_preloaded_blas_turns_the_status_off_and_the_tests_skip(tmp_path):
    out = _child(tmp_path, LD_PRELOAD=str(OPENBLAS))
    assert out.startswith("False False off (cblas_sgemm resolves to") and "LD_PRELOAD" in out, out
    env = {**os.environ, "LD_PRELOAD": str(OPENBLAS), "CLP_MLX_HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_few_rows.py"], cwd=REPO, env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 0 and " skipped" in run.stdout, run.stdout[-2000:]


@needs_openblas
@needs_compiler
def test_in_a_private_cache_the_kernel_answers(tmp_path):
    assert _child(tmp_path) == "True True on"
    (lib,) = (tmp_path / "few_rows").iterdir()
    assert lib.stat().st_mode & 0o022 == 0 and (tmp_path / "few_rows").stat().st_mode & 0o077 == 0


@needs_openblas
@needs_compiler
def test_a_library_others_could_write_is_never_loaded(tmp_path):
    marker = tmp_path / "planted-code-ran"
    lib = _plant(tmp_path, marker)
    lib.chmod(0o775)  # group-writable: anyone in the group could have put it there
    assert _child(tmp_path) == "True True on"  # rebuilt in place, ours again
    assert not marker.exists() and lib.stat().st_mode & 0o022 == 0
    (tmp_path / "few_rows").chmod(0o777)  # ours, but open to all: tightened
    assert _child(tmp_path) == "True True on"
    assert (tmp_path / "few_rows").stat().st_mode & 0o022 == 0


@needs_openblas
@needs_compiler
@pytest.mark.skipif(os.geteuid() != 0, reason="handing files to another user needs root")
def test_a_cache_folder_of_another_user_is_not_trusted(tmp_path):
    marker = tmp_path / "planted-code-ran"
    lib = _plant(tmp_path, marker)
    for path in (lib, lib.parent):
        os.chown(path, 65534, 65534)  # nobody's
    out = _child(tmp_path)
    assert out.startswith("True True on (built privately: the cache is not private:"), out
    assert not marker.exists()
    assert lib.stat().st_uid == 65534  # left as it was


@needs_openblas
@needs_compiler
def test_an_unwritable_cache_builds_the_kernel_privately(tmp_path):
    (tmp_path / "file").write_text("x")
    out = _child(tmp_path / "file" / "cache")
    assert out.startswith("True True on (built privately: the cache cannot be used:"), out
    assert (tmp_path / "file").read_text() == "x"
