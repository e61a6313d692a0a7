"""The stages and their import direction (.importlinter), checked with import-linter."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_each_stage_imports_only_stages_below_and_no_entry_point_another():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which(
        "lint-imports"
    )
    assert lint, "import-linter is missing: pip install -e '.[test]'"
    out = subprocess.run(
        [lint, "--config", str(REPO / ".importlinter")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": str(Path(sys.executable).parent)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout
