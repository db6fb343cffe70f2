"""ruff over the source and the tests with pyproject.toml's small rule set ([tool.ruff.lint]):
undefined names, unused imports and variables, names defined twice, mutable defaults."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("megacompile", "kernels", "passes", "tests", "benchmarks")


def _ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is not installed: pip install -e '.[test]' installs it"
    return subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", *args], cwd=cwd,
                          capture_output=True, text=True)


def test_the_source_and_tests_pass_the_lint_rules():
    done = _ruff(*FOLDERS)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_rules_name_a_planted_unused_import_and_undefined_name(tmp_path):
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "planted.py").write_text("import os\n\n\ndef f():\n    return undefined_name\n")
    done = _ruff("planted.py", cwd=tmp_path)
    assert done.returncode == 1
    assert "planted.py:1:8: F401" in done.stdout and "planted.py:5:12: F821" in done.stdout, done.stdout
