"""The subprocess side of tests/test_hostile.py: runs hostile cases one by one.

    python tests/hostile_probe.py CASES.json RESULTS.jsonl

Each case is an entry point run in this process (a command through runpy, as
``python -m`` runs it, or an API call). Before a case starts a ``start`` line is
written to RESULTS, after it an ``end`` line with its outcome, each flushed
and synced: when a case kills the process, the parent sees which one did and
starts a new process for the cases after it. Nothing here is a test; the
verdicts are the parent's.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import signal
import sys
import traceback
import warnings

import clp_mlx  # noqa: F401  (OpenBLAS before mlx, as every entry point does)

warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
CASE_SECONDS = 90  # a case still running after this is reported as hung


class Hung(BaseException):
    """Raised in a case that runs too long (SIGALRM; C code finishes its call first)."""


def _alarm(signum, frame):
    raise Hung(f"still running after {CASE_SECONDS} s")


def _tail(text: str, n: int = 4000) -> str:
    return text[-n:]


def _run_cli(case: dict) -> dict:
    """One command, as ``python -m MODULE ARGV`` with stdin, in the case's cwd."""
    stdin = case.get("stdin", "").encode("latin-1")
    sys.argv = [case["module"], *case["argv"]]
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8", errors="strict")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(case["module"], run_name="__main__", alter_sys=True)
            rc = 0
        except Hung as e:
            print(f"hostile probe: {e}", file=sys.stderr)
            rc = "hung"
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                rc = e.code or 0
            else:  # sys.exit("message"): Python prints it and exits 1
                print(e.code, file=sys.stderr)
                rc = 1
        except BaseException:  # noqa: BLE001  (what Python would print before exiting 1)
            traceback.print_exc()
            rc = 1
    return outcome(rc, out.getvalue(), err.getvalue())


def outcome(rc: int, out: str, err: str) -> dict:
    """A command's result: exit code, what its whole stderr shows, and the tails of both."""
    lines = err.splitlines()
    return {
        "rc": rc,
        "traceback": "Traceback (most recent call last)" in err,
        "error_line": any(line.startswith("error:") for line in lines),
        "usage_line": any(line.startswith("usage:") for line in lines),
        "out": _tail(out),
        "err": _tail(err),
    }


def _value(spec):
    """A JSON-borne argument; {"path": p} stands for pathlib.Path(p)."""
    from pathlib import Path

    if isinstance(spec, dict) and set(spec) == {"path"}:
        return Path(spec["path"])
    return spec


_LOADED: dict = {}


def _run_api(case: dict) -> dict:
    """``load`` (memoised when ``reuse``), then ``generate`` for each of ``runs``."""
    from clp_mlx import generate
    from clp_mlx.api import load_with_drafter as load
    from clp_mlx.errors import ClpError

    key = json.dumps([case.get("model"), case.get("heads")])
    try:
        if case.get("reuse") and key in _LOADED:
            model, tokenizer, heads = _LOADED[key]
        else:
            model, tokenizer, heads = load(_value(case.get("model")), _value(case.get("heads")))
            if case.get("reuse"):
                _LOADED[key] = (model, tokenizer, heads)
        texts = []
        for run in case.get("runs", []):
            options = {"max_tokens": 3, **run.get("options", {})}
            texts.append(generate(model, tokenizer, run["prompt"], heads, **options))
        return {"outcome": "ok", "detail": repr(texts)[:300]}
    except ClpError as e:
        return {"outcome": "clp", "detail": str(e)[:600]}
    except Hung as e:
        return {"outcome": "exc", "detail": f"hung: {e}"}
    except Exception:  # noqa: BLE001  (anything but ClpError is the finding)
        return {"outcome": "exc", "detail": _tail(traceback.format_exc(), 1500)}


def _redirect_shipped(folder: str) -> bool:
    """Point heads-to-package at ``folder``: a case must never write into the package."""
    from pathlib import Path

    from clp_mlx.sources import packaging

    if not hasattr(packaging, "SHIPPED"):
        return False
    packaging.SHIPPED = Path(folder)
    return True


def _forget_measured() -> None:
    """Pass costs are measured once per process and setup: make each case a new process's."""
    try:
        from clp_mlx.decode import feed

        feed.forget_measured()
    except (ImportError, AttributeError):
        pass


def main(cases_file: str, results_file: str) -> None:
    signal.signal(signal.SIGALRM, _alarm)
    with open(cases_file, encoding="utf-8") as f:
        cases = json.load(f)
    base_env = dict(os.environ)
    with open(results_file, "a", encoding="utf-8") as results:

        def note(record: dict) -> None:
            results.write(json.dumps(record) + "\n")
            results.flush()
            os.fsync(results.fileno())

        for case in cases:
            note({"id": case["id"], "phase": "start"})
            os.environ.clear()
            os.environ.update({**base_env, **case.get("env", {})})
            os.chdir(case["cwd"])
            _forget_measured()
            if "shipped" in case and not _redirect_shipped(case["shipped"]):
                result = outcome(None, "", "not run: packaging.SHIPPED is gone")
            else:
                signal.alarm(CASE_SECONDS)
                try:
                    result = _run_cli(case) if "module" in case else _run_api(case)
                finally:
                    signal.alarm(0)
            sys.stdin = sys.__stdin__
            note({"id": case["id"], "phase": "end", **result})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
