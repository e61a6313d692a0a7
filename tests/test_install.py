"""Installed as the README says, in a fresh virtual environment: a clone of
this repository, the macOS set-up line (the Linux one less its system
packages, which this machine has), then the README's run command on a tiny
model folder (slow: it installs every dependency, from pip's cache if warm).
The README's test command is what ``.ci/run`` runs on a clean clone."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import tiny_model, write_model_folder

ROOT = Path(__file__).resolve().parents[1]


def readme_command(label: str) -> str:
    """The command under the first comment line of the README's first code
    block that contains ``label``."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL).group(1)
    lines = block.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("#") and label in line:
            return lines[i + 1].strip()
    raise AssertionError(f"no README command under a comment with {label!r}")


def test_the_readme_commands_are_what_this_test_runs():
    linux, mac = readme_command("set up, Linux"), readme_command("set up, macOS")
    # the two set-up lines differ only by the system packages
    assert linux.endswith(mac) and linux[: -len(mac)].startswith("sudo apt-get install")
    assert readme_command("run").startswith("python -m clp_mlx.generate")
    assert readme_command("test") == "python -m pytest -q"
    assert "python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow
def test_a_fresh_clone_installs_and_runs_as_the_readme_says(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is needed to clone the repository")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    folder = write_model_folder(tmp_path / "tiny", tiny_model(0))
    run = f"{readme_command('run')} --model {folder} -m 8"
    script = f"set -e\n{readme_command('set up, macOS')}\n{run}\n"
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(Path.home()),
           "HF_HUB_OFFLINE": "1", "CLP_MLX_HOME": str(tmp_path / "home")}  # fmt: skip
    for key in ("PIP_FIND_LINKS", "PIP_CERT", "SSL_CERT_FILE", "PIP_DEFAULT_TIMEOUT"):
        if key in os.environ:
            env[key] = os.environ[key]
    done = subprocess.run(
        ["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True, timeout=1800,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Generation: " in done.stdout  # --verbose is on by default, as in mlx-lm
