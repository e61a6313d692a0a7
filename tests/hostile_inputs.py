"""Machinery of tests/test_hostile.py: cases, the subprocess runs, the verdicts.

A :class:`Case` owns a fresh folder: ``in/`` (its inputs), ``cwd/`` (the
working directory of its run), ``home/`` (its ``CLP_MLX_HOME``). Every file
under the folder is snapshotted before the run and compared after: what a case
may change is listed in ``may_change``; the cache (``home/``) may gain files,
never ``.partial-``/``.old-`` leftovers. Cases run in batches through
``hostile_probe.py`` in one subprocess (a crash of one case kills that process
only; the batch goes on in a new one), or one by one as real commands
(:func:`run_real`) where the process itself matters: stdin bytes, the native
kernel's loading.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings

HERE = Path(__file__).resolve().parent
PROBE = HERE / "hostile_probe.py"
SHIPPED = HERE.parent / "clp_mlx" / "shipped"
LEFTOVER_MARKS = (".partial-", ".old-", ".wheels-", ".hub-")  # what paths.py names temporaries
BATCH_TIMEOUT = 240  # s, for one driver process; a hung case is reported as hung


def examples(strategy, n: int) -> list:
    """``n`` derandomized examples of a Hypothesis strategy (no shrinking: the
    examples become inputs of cases run in a subprocess, judged there)."""
    found = []

    @settings(
        max_examples=n,
        derandomize=True,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(value):
        found.append(value)

    collect()
    unique = []
    for value in found:
        if value not in unique:
            unique.append(value)
    return unique


def dead_pid() -> int:
    """The id of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    try:
        os.kill(proc.pid, 0)
    except ProcessLookupError:
        return proc.pid
    raise RuntimeError("the reaped process id is in use again")


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root``: relative path -> kind and content digest."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = "link:" + os.readlink(path)
        elif path.is_dir():
            found[rel] = "dir"
        elif path.is_file():
            found[rel] = "file:" + hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[rel] = "other"
    return found


def base_env(home: Path, tmp: Path) -> dict[str, str]:
    """The environment of every run: no network, nothing written outside ``tmp``."""
    env = dict(os.environ)
    for name in ("CLP_MLX_FEW_ROWS", "CLP_MLX_BLAS", "CLP_MLX_PAD_ROWS", "PYTHONSTARTUP"):
        env.pop(name, None)
    (tmp / "fake-home").mkdir(exist_ok=True)
    (tmp / "tmpdir").mkdir(exist_ok=True)
    env.update(
        CLP_MLX_HOME=str(home),
        HOME=str(tmp / "fake-home"),
        TMPDIR=str(tmp / "tmpdir"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONPATH=str(HERE),
        LC_ALL="C.UTF-8",
        MPLCONFIGDIR=str(tmp / "mplconfig"),  # matplotlib's font cache, not the project's
    )
    return env


@dataclass
class Case:
    """One hostile input to one entry point, and what a clean end is for it."""

    name: str
    cls: str  # the class of hostile input (see test_hostile.py), for the tally
    root: Path
    spec: dict = field(default_factory=dict)
    expect: tuple = (1,)  # commands: allowed exit codes
    want: str = "clean"  # API: "clp" (must raise ClpError), "ok", or "clean" (either)
    may_change: tuple = ()  # paths (relative to the case folder) the run may write or remove
    may_add: tuple = ()  # folders the run may add entries to, keeping what is there
    check: object = None  # extra check: f(case, result) -> problem or None
    result: dict | None = None
    before: dict | None = None

    def __post_init__(self):
        for sub in ("in", "cwd", "home"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    @property
    def inp(self) -> Path:
        return self.root / "in"

    @property
    def cwd(self) -> Path:
        return self.root / "cwd"

    @property
    def home(self) -> Path:
        return self.root / "home"

    def cli(self, module: str, *argv, stdin: bytes = b"", **kw) -> Case:
        self.spec = {
            "module": module,
            "argv": [str(a) for a in argv],
            "stdin": stdin.decode("latin-1"),
        }
        return self._set(**kw)

    def api(self, model, heads=None, runs=(), reuse=False, **kw) -> Case:
        self.spec = {"model": model, "heads": heads, "runs": list(runs), "reuse": reuse}
        return self._set(**kw)

    def _set(self, **kw) -> Case:
        for key, value in kw.items():
            setattr(self, key, value)
        return self

    def problem(self) -> str | None:
        """What was not clean about this case's run, or None."""
        r = self.result
        if r is None:
            return "not run"
        if r.get("died"):
            return r["died"]
        if "module" in self.spec:
            found = self._command_problem(r)
        else:
            found = self._api_problem(r)
        return found or self._files_problem() or (self.check(self, r) if self.check else None)

    def _command_problem(self, r: dict) -> str | None:
        err, rc = r["err"], r["rc"]
        if r["traceback"]:
            return f"exit {rc} with a traceback: ...{err[-700:]}"
        if rc not in self.expect:
            tails = f"stderr: {err[-300:]!r}; stdout: {r['out'][-200:]!r}"
            return f"exit {rc} (want {self.expect}); {tails}"
        if rc == 1 and not r["error_line"]:
            return f"exit 1 without an 'error:' line; stderr: {err[-300:]!r}"
        if rc == 2 and not r["usage_line"]:
            return f"exit 2 without a 'usage:' line; stderr: {err[-300:]!r}"
        return None

    def _api_problem(self, r: dict) -> str | None:
        outcome = r.get("outcome")
        if outcome == "exc":
            return f"raised something else than ClpError: ...{r['detail'][-700:]}"
        if self.want == "clp" and outcome != "clp":
            return f"accepted (want ClpError): {r['detail'][:200]}"
        if self.want == "ok" and outcome != "ok":
            return f"refused (want success): {r['detail'][:300]}"
        return None

    def _files_problem(self) -> str | None:
        after = snapshot(self.root)

        def under(rel, paths):
            return any(rel == str(Path(p)) or rel.startswith(str(Path(p)) + os.sep) for p in paths)

        touched = []
        for rel in sorted(set(self.before) | set(after)):
            was, now = self.before.get(rel), after.get(rel)
            if was == now:
                continue
            if now is not None and any(m in Path(rel).name for m in LEFTOVER_MARKS):
                touched.append(f"leftover {rel}")
            elif (
                (rel.split(os.sep)[0] == "home" and now is not None)
                or under(rel, self.may_change)
                or was is None
                and under(rel, self.may_add)
            ):
                continue
            else:
                touched.append(
                    ("gone " if now is None else "new " if was is None else "changed ") + rel
                )
        return f"files touched: {', '.join(touched[:8])}" if touched else None


class Batch:
    """Cases that run together in one probe process (more if one kills it)."""

    def __init__(self, root: Path, kernel_home: Path):
        self.root, self.kernel_home = root, kernel_home
        self.cases: list[Case] = []

    def new(self, name: str, cls: str, **kw) -> Case:
        case = Case(name, cls, self.root / "cases" / name.replace("/", "_"), **kw)
        assert all(c.name != name for c in self.cases), name
        self.cases.append(case)
        return case

    def run(self) -> None:
        for case in self.cases:
            case.before = snapshot(case.root)
        pending = [c for c in self.cases if c.spec]
        work = self.root / "probe"
        work.mkdir(exist_ok=True)
        env = base_env(self.kernel_home, self.root)
        attempt = 0
        while pending and attempt < 12:
            attempt += 1
            specs = [
                {
                    "id": c.name,
                    "cwd": str(c.cwd),
                    "env": {"CLP_MLX_HOME": str(c.home)},
                    **c.spec,
                }
                for c in pending
            ]
            cases_file, results_file = (
                work / f"cases-{attempt}.json",
                work / f"results-{attempt}.jsonl",
            )
            cases_file.write_text(json.dumps(specs))
            try:
                proc = subprocess.run(
                    [sys.executable, str(PROBE), str(cases_file), str(results_file)],
                    cwd=work,
                    env=env,
                    capture_output=True,
                    timeout=BATCH_TIMEOUT,
                    check=False,
                )
                fate, tail = _fate(proc.returncode), proc.stderr.decode(errors="replace")[-500:]
            except subprocess.TimeoutExpired as e:
                fate, tail = f"hung (killed after {BATCH_TIMEOUT} s)", str(e.stderr or "")[-500:]
            ended, started = {}, None
            if results_file.exists():
                for line in results_file.read_text().splitlines():
                    record = json.loads(line)
                    if record["phase"] == "start":
                        started = record["id"]
                    else:
                        ended[record["id"]] = record
                        started = None
            by_name = {c.name: c for c in pending}
            for name, record in ended.items():
                by_name[name].result = record
            if started is not None:
                by_name[started].result = {"died": f"the process {fate}; stderr: {tail!r}"}
            elif pending and not ended and fate != "exited 0":
                raise RuntimeError(f"the probe process {fate} before any case: {tail}")
            pending = [c for c in pending if c.result is None]


def _fate(rc: int) -> str:
    if rc < 0:
        return f"died of signal {-rc}"
    return f"exited {rc}"


def run_real(case: Case, argv: list, *, stdin: bytes = b"", env: dict | None = None, timeout=120):
    """Run a real ``python ARGV`` for ``case`` in its cwd with its home; keep the result.
    ``HOME`` and ``TMPDIR`` are those of the case's batch root (``case.root.parents[1]``)."""
    case.spec = {"module": argv[1] if argv[:1] == ["-m"] else argv[0], "argv": argv}
    case.before = snapshot(case.root)
    full_env = {**base_env(case.home, case.root.parents[1]), **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None: unset it
    tic = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, *map(str, argv)],
            cwd=case.cwd,
            env=full_env,
            input=stdin,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        case.result = {"died": f"hung (killed after {timeout} s)"}
        return case.result
    out, err = (s.decode("utf-8", errors="replace") for s in (proc.stdout, proc.stderr))
    if proc.returncode < 0:
        case.result = {"died": f"{_fate(proc.returncode)}; stderr: {err[-500:]!r}"}
    else:
        lines = err.splitlines()
        case.result = {
            "rc": proc.returncode,
            "traceback": "Traceback (most recent call last)" in err,
            "error_line": any(line.startswith("error:") for line in lines),
            "usage_line": any(line.startswith("usage:") for line in lines),
            "out": out,
            "err": err,
        }
    case.result["seconds"] = time.perf_counter() - tic
    return case.result


def copy_kernel(home: Path, kernel_home: Path) -> None:
    """Give a case's cache the kernel built once for the session (no compile per case)."""
    if (kernel_home / "few_rows").is_dir() and not (home / "few_rows").exists():
        shutil.copytree(kernel_home / "few_rows", home / "few_rows")


def verdicts(cases: list[Case], tally: dict) -> list[str]:
    """The problems of ``cases`` (one line each), counted into ``tally``."""
    problems = []
    for case in cases:
        problem = case.problem()
        tally["tried"] += 1
        tally["clean"] += problem is None
        tally.setdefault("by_class", {}).setdefault(case.cls, [0, 0])
        tally["by_class"][case.cls][0] += 1
        tally["by_class"][case.cls][1] += problem is None
        if problem:
            problems.append(f"{case.name}: {problem}")
    return problems


# -- a kernel planted where the native stage caches the real one ------------------------------

PLANT = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *mark = getenv("HOSTILE_MARK");
    if (mark) { FILE *f = fopen(mark, "w"); if (f) { fputs("loaded\n", f); fclose(f); } }
}
void few_rows_init(void *sgemm) { (void)sgemm; }
long few_rows_served(void) { return 0; }
"""


def plant_kernel(home: Path, work: Path) -> Path | None:
    """Compile :data:`PLANT` to the file name under which ``few_rows.build`` caches the
    kernel in ``home`` (the same key: source, compiler and flags, CPU); None without cc.
    Loading it writes the file named by ``$HOSTILE_MARK``."""
    from clp_mlx.native import few_rows

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    cpu = few_rows.cpu_info()
    key = hashlib.sha256()
    for part in (few_rows.SOURCE.read_bytes(), " ".join([cc, *few_rows._flags(cpu)]).encode()):
        key.update(part)
    key.update(cpu.encode())
    target = home / "few_rows" / f"few_rows-{key.hexdigest()[:16]}.so"
    target.parent.mkdir(parents=True, exist_ok=True)
    (work / "plant.c").write_text(PLANT)
    subprocess.run([cc, "-shared", "-fPIC", "-o", target, work / "plant.c"], check=True, timeout=60)
    return target


def as_an_attacker(paths) -> None:
    """Make ``paths`` what someone else could have put there: another user's where we
    may (as root), else writable by everyone."""
    for path in paths:
        if os.geteuid() == 0:
            os.chown(path, 65534, 65534)
        path.chmod(0o777)
