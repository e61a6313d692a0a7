"""Hostile input against every entry point: each must end cleanly.

Clean: a command exits 1 with an ``error:`` line (argparse: 2 and ``usage:``),
or 0 where the input may be accepted, never with a traceback or a signal; an
API call raises ``ClpError`` (or succeeds where it may); no file outside what
the run may write is touched, the working directory included; nothing half
written is left behind. Every case runs in a subprocess with a fresh working
directory, its own ``CLP_MLX_HOME`` and a throw-away ``HOME`` and ``TMPDIR``.
Cases: tests/hostile_cases.py (the groups; their builders in hostile_cases_*.py);
machinery: tests/hostile_inputs.py and the subprocess side, tests/hostile_probe.py.
Classes of hostile input:

1. process death from data (heads files, prompt ids)   2. data loss (converters' -o)
3. tracebacks for user errors                           4. leftovers of killed runs
5. silent acceptance                                    6/7. platform and trust
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
from hostile_cases import GROUPS, link, make_inputs
from hostile_inputs import (
    SHIPPED,
    Batch,
    Case,
    as_an_attacker,
    base_env,
    copy_kernel,
    plant_kernel,
    run_real,
    snapshot,
    verdicts,
)

TALLY: dict = {"tried": 0, "clean": 0}


@pytest.fixture(scope="module", autouse=True)
def tally(request, tmp_path_factory):
    """Count the inputs tried and handled cleanly; print and keep the count at the end."""
    yield TALLY
    by_class = TALLY.get("by_class", {})
    per_class = ", ".join(f"class {k}: {c}/{n}" for k, (n, c) in sorted(by_class.items()))
    line = f"hostile inputs: {TALLY['tried']} tried, {TALLY['clean']} clean ({per_class})"
    (tmp_path_factory.getbasetemp() / "hostile_tally.txt").write_text(line + "\n")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():
        print(f"\n{line}")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The module's folder, the kernel built once, the valid inputs; after every case:
    the inputs, the package's shipped heads, HOME and TMPDIR are as they were."""
    root = tmp_path_factory.mktemp("hostile")
    kernel_home = root / "kernel-home"
    env = base_env(kernel_home, root)
    subprocess.run(
        [sys.executable, "-c", "import clp_mlx"], cwd=root, env=env, check=True, timeout=300
    )
    inputs = make_inputs(root / "shared")
    shared_before, shipped_before = snapshot(root / "shared"), snapshot(SHIPPED)
    yield root, kernel_home, inputs
    assert snapshot(root / "shared") == shared_before, "a case changed the shared inputs"
    assert snapshot(SHIPPED) == shipped_before, "a case wrote into the package's shipped heads"
    left = [p for name in ("fake-home", "tmpdir") for p in (root / name).iterdir()]
    left = [str(p.relative_to(root)) for p in left if p != root / "tmpdir" / "mlx"]  # MLX's JIT
    assert not left, f"written outside the cases' folders (HOME, TMPDIR): {left[:5]}"


@pytest.fixture(scope="module")
def world(base):
    """Every batched case, built and run once (one probe process; more only after a crash)."""
    root, kernel_home, inputs = base
    batch = Batch(root, kernel_home)
    groups = {}
    for name, build in GROUPS.items():
        first = len(batch.cases)
        build(batch, inputs)
        groups[name] = batch.cases[first:]
    batch.run()
    return groups


def check(cases: list[Case]) -> None:
    problems = verdicts(cases, TALLY)
    assert not problems, f"{len(problems)} of {len(cases)} not clean:\n" + "\n".join(problems)


@pytest.mark.parametrize("group", list(GROUPS))
def test_batched_entry_points(world, group):
    check(world[group])


# -- cases where the process itself matters: real commands, one each --------------------------


@pytest.fixture(scope="module")
def real(base):
    """A factory of cases for real commands, with the kernel already in their cache."""
    root, kernel_home, inputs = base

    def new(name: str, cls: str, **kw) -> Case:
        case = Case(name, cls, root / "real" / name, **kw)
        copy_kernel(case.home, kernel_home)
        return case

    return new, inputs


def generate_argv(model, *flags) -> list:
    return ["-m", "clp_mlx.generate", "--model", model, "--heads", "init", *flags]


def chat_argv(model) -> list:
    return ["-m", "clp_mlx.chat", "--model", model, "--heads", "init", "-m", "2"]


@pytest.mark.parametrize(
    "name, env",
    [("utf8", {"LC_ALL": "C.UTF-8"}), ("c-locale", {"LC_ALL": "C", "LANG": "C"})],
    ids=["utf8", "c-locale"],
)
def test_non_utf8_prompt_on_stdin(real, name, env):
    new, s = real
    case = new(f"stdin-bytes-{name}", "3", expect=(0, 1))
    argv = generate_argv(s.model, "-p", "-", "-m", "2")
    run_real(case, argv, stdin=b"\xff\xfehello \x80\xc3(\n", env=env)
    check([case])


def test_chat_commands_are_not_prompts(real):
    """/foo is an unknown command, not a turn; /mode with a bad mode says why."""

    def no_turns(case, result):
        out = result["out"]
        if "prefill" in out:
            return f"a command was answered as a prompt: {out[-400:]!r}"
        if "/foo" not in out:
            return f"/foo was not named as unknown: {out[-400:]!r}"
        return None

    new, s = real
    case = new("chat-commands", "5", expect=(0,), check=no_turns)
    run_real(case, chat_argv(s.chat_model), stdin=b"/foo\n/mode bogus\n/mode\n/\nq\n")
    check([case])


def test_chat_non_utf8_line(real):
    new, s = real
    case = new("chat-bytes", "3", expect=(0, 1))
    run_real(case, chat_argv(s.chat_model), stdin=b"\xff\xfe\x80 hi\n/quit\n")
    check([case])


def test_unwritable_output_and_cache(real):
    """An output folder or a cache that cannot be written: one error line, nothing left."""
    new, s = real
    out_case, cache_case = new("read-only-output", "3"), new("read-only-cache", "3")
    locked = out_case.inp / "locked"
    locked.mkdir()
    for case in (out_case, cache_case):
        link(s.gguf, case.inp / "x.gguf")
    for folder in (locked, cache_case.home):
        folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: chmod 0o500 does not stop writes")
        convert = ["-m", "clp_mlx.cli.convert", "gguf", out_case.inp / "x.gguf", "--no-progress"]
        run_real(out_case, [*convert, "-o", locked / "out"])
        run_real(cache_case, generate_argv(cache_case.inp / "x.gguf", "-p", "hi", "-m", "2"))
        check([out_case, cache_case])
    finally:
        for folder in (locked, cache_case.home):
            folder.chmod(0o700)


STATUS = (
    "import json, clp_mlx; from clp_mlx.native import blas; print(json.dumps(vars(blas.status())))"
)


@pytest.mark.parametrize("world_writable", [False, True], ids=["control-0700", "world-writable"])
def test_planted_kernel_in_world_writable_cache(real, world_writable):
    """Control (0o700, our file): the planted library is exactly where the kernel is
    looked for, and loads. World-writable home, the library and its folder another
    user's: anyone could have put it there; it must not be loaded, and the status must
    say why the cached kernel was not used."""

    def verdict(case, result):
        status = json.loads(result["out"].strip().splitlines()[-1])
        if not world_writable:
            if not mark.exists():
                return f"control: the plant did not load, so the test plants it wrongly ({status})"
            return None
        if mark.exists():
            return f"a kernel from a world-writable cache was loaded: {status}"
        if not any(word in status["note"] for word in ("writable", "private", "user", "trust")):
            return f"the status does not say why the cached kernel was not used: {status}"
        return None

    new, _ = real
    name = f"plant-{'777' if world_writable else '700'}"
    case = new(name, "6/7", expect=(0,), check=verdict, may_change=["loaded.txt"])
    mark = case.root / "loaded.txt"
    shutil.rmtree(case.home / "few_rows", ignore_errors=True)
    planted = plant_kernel(case.home, case.inp)
    if planted is None:
        pytest.skip("no C compiler")
    case.home.chmod(0o777 if world_writable else 0o700)
    if world_writable:
        as_an_attacker([planted.parent, planted])
    # LD_PRELOAD unset: a preloaded BLAS would shadow the kernel whether planted or not.
    run_real(case, ["-c", STATUS], env={"HOSTILE_MARK": str(mark), "LD_PRELOAD": None})
    check([case])
