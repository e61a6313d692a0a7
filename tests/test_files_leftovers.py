"""Temporaries a killed run leaves (``.NAME.partial-<pid>...``) are removed by the
next run that writes beside them, and nothing else is: not a live run's, not a
user's hidden file. Outputs follow the user's umask."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clp_mlx import paths


def _dead_pid() -> int:
    """A pid that no process has now (a child that has exited and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _killed_while_writing(tmp_path: Path, body: str) -> None:
    """Run ``body`` in a child that SIGKILLs itself in the middle of a write."""
    code = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from clp_mlx import paths
        out = Path({str(tmp_path)!r})
        def die():
            os.kill(os.getpid(), signal.SIGKILL)
    """) + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == -signal.SIGKILL, done.stderr


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_what_a_sigkill_leaves_is_cleared_by_the_next_write(tmp_path):
    _killed_while_writing(tmp_path, """
        with paths.atomic_folder(out / "model") as tmp:
            (tmp / "big.safetensors").write_bytes(b"x" * 1000)
            die()
    """)
    _killed_while_writing(tmp_path, """
        with paths.atomic_file(out / "data.bin") as tmp:
            tmp.write_bytes(b"half")
            die()
    """)
    left = _names(tmp_path)
    assert len(left) == 2 and left[0].startswith(".data.bin.partial-"), left
    _killed_while_writing(tmp_path, """
        with paths.scratch_folder(out / "data.bin", "wheels") as work:
            (work / "part1.whl").write_bytes(b"w")
            die()
    """)
    left = _names(tmp_path)  # the killed file's temporary went when the scratch folder came
    assert len(left) == 2 and left[0].startswith(".data.bin.wheels-"), left
    with paths.atomic_folder(tmp_path / "model") as tmp:
        (tmp / "config.json").write_text("{}")
    paths.write_text(tmp_path / "data.bin", "whole")
    assert _names(tmp_path) == ["data.bin", "model"]
    assert (tmp_path / "data.bin").read_text() == "whole"


def test_a_killed_replacement_gives_the_old_output_back(tmp_path):
    """Killed between renaming the old output aside and the new one into place."""
    pid = _dead_pid()
    old = tmp_path / f".model.old-{pid}"
    old.mkdir()
    (old / "config.json").write_text("old")
    assert paths.sweep(tmp_path, "model") == [old]
    assert (tmp_path / "model" / "config.json").read_text() == "old"
    old.mkdir()  # now the name is taken: a stale old copy is just removed
    assert paths.sweep(tmp_path, "model") == [old] and not old.exists()


def test_live_and_foreign_names_are_left_alone(tmp_path):
    live = tmp_path / f".model.partial-{os.getpid()}-abc"  # this process, written just now
    parent = tmp_path / f".model.partial-{os.getppid()}"
    mine = [tmp_path / n for n in (".model", ".model.partial", ".model.partial-", ".model.backup-1",
                                   ".model.partial-12x", "model.partial-1", ".other.partial-1")]
    for p in [live, parent, *mine]:
        p.mkdir()
    assert paths.sweep(tmp_path, "model") == []
    assert all(p.exists() for p in [live, parent, *mine])


def test_a_reused_pid_does_not_keep_a_leftover(tmp_path):
    """Our own pid in the name, but the temporary is older than this process: stale."""
    stale = tmp_path / f".model.partial-{os.getpid()}"
    stale.write_bytes(b"x")
    started = paths.process_start(os.getpid())
    if started is None or started == float("-inf"):
        pytest.skip("no process start times here")
    os.utime(stale, (started - 60, started - 60))
    assert paths.sweep(tmp_path, "model") == [stale]


def test_a_locked_temporary_is_kept_even_with_a_dead_pid(tmp_path):
    """Another pid namespace (a container) may own it: its lock says so."""
    held = tmp_path / f".model.partial-{_dead_pid()}-xyz"
    held.mkdir()
    with paths._held(held):
        child = subprocess.run(
            [sys.executable, "-c", f"from clp_mlx import paths; print(len(paths.sweep({str(tmp_path)!r})))"],
            capture_output=True, text=True, check=False)
        assert child.stdout.strip() == "0", child.stderr
    assert held.exists()
    assert paths.sweep(tmp_path) == [held]


def test_pidless_leftovers_of_older_versions_go_after_a_day(tmp_path):
    legacy = tmp_path / ".model.partial-ab3_x9qz"
    legacy.mkdir()
    assert paths.sweep(tmp_path) == []
    day_ago = time.time() - paths.LEGACY_AGE_S - 60
    os.utime(legacy, (day_ago, day_ago))
    assert paths.sweep(tmp_path) == [legacy]


def test_the_cache_is_swept_whole_and_other_folders_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("CLP_MLX_HOME", str(tmp_path / "cache"))
    pid = _dead_pid()
    for folder in (tmp_path / "cache" / "models", tmp_path / "work"):
        folder.mkdir(parents=True)
        for name in ("a", "b"):
            (folder / f".{name}.partial-{pid}-q").mkdir()
        paths.write_text(folder / "a", "x")
    assert _names(tmp_path / "cache" / "models") == ["a"]
    assert _names(tmp_path / "work") == [f".b.partial-{pid}-q", "a"]


_hidden = st.text(st.sampled_from("abc.-_0123456789xyzpartilodwhe"), min_size=1, max_size=24).filter(lambda n: n != ".")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names=st.lists(_hidden, min_size=1, max_size=6, unique=True))
def test_sweep_removes_only_dead_temporaries_of_ours(tmp_path_factory, names):
    """Whatever hidden names a folder holds, only ``.NAME.<kind>-<dead pid>[-x]`` go."""
    folder = tmp_path_factory.mktemp("sweep")
    for n in names:
        (folder / f".{n}").write_bytes(b"")
    gone = {p.name for p in paths.sweep(folder)}
    for n in names:
        m = paths._TEMP.match(f".{n}")
        ours = bool(m) and m["kind"] in paths.KINDS and paths.process_start(int(m["pid"])) is None
        assert (f".{n}" in gone) == ours, n
        assert (folder / f".{n}").exists() != ours or (m and m["kind"] == "old")


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_folders_follow_the_umask_not_mkdtemp(tmp_path, mask):
    old = os.umask(mask)
    try:
        with paths.atomic_folder(tmp_path / "out") as tmp:
            (tmp / "f").write_text("x")
        assert paths.umask() == mask
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~mask


def test_a_converter_killed_mid_write_leaves_nothing_the_next_run_keeps(tmp_path, monkeypatch):
    """SIGKILL in the middle of saving, into a folder and into the cache: the
    next conversion or resolution clears the partial model and finishes."""
    from gguf_fixtures import write_tiny_gguf

    from clp_mlx.sources.gguf import convert_gguf
    from clp_mlx.sources.resolve import resolve_model

    write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv("CLP_MLX_HOME", str(tmp_path / "cache"))
    for call in ("convert_gguf(out / 'tiny.gguf', out / 'model', progress=False)",
                 "resolve_model(str(out / 'tiny.gguf'), progress=False, offline=True)"):
        _killed_while_writing(tmp_path, f"""
            import os
            os.environ["CLP_MLX_HOME"] = str(out / "cache")
            from clp_mlx.sources import gguf
            from clp_mlx.sources.gguf import convert_gguf
            from clp_mlx.sources.resolve import resolve_model
            save = gguf._save_weights
            gguf._save_weights = lambda folder, weights: (save(folder, weights), die())
            {call}
        """)
    models = tmp_path / "cache" / "models"
    assert [p.name for p in tmp_path.glob(".model.partial-*")] and list(models.glob(".*.partial-*"))
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "model", progress=False)
    resolved = resolve_model(str(tmp_path / "tiny.gguf"), progress=False, offline=True)
    assert not list(tmp_path.glob(".*")) and [p.name for p in models.iterdir()] == [resolved.name]
    assert (resolved / "made_from.json").is_file() and (tmp_path / "model" / "made_from.json").is_file()
