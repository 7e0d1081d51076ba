"""The lint `make test` runs sees every Python file the repository tracks: a folder that a
tool skips by default (ruff's default `exclude` holds `dist`, `build`, `.venv` and others)
must not hide a package from it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _lines(*cmd: str) -> set[str]:
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    return {line.strip() for line in done.stdout.splitlines() if line.strip()}


def test_ruff_covers_every_tracked_python_file():
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout: the tracked files are unknown")
    ruff = Path(sys.executable).with_name("ruff")
    tracked = _lines("git", "ls-files", "*.py")
    checked = {
        str(Path(line).resolve().relative_to(ROOT))
        for line in _lines(str(ruff), "check", "--show-files", ".")
        if line.endswith(".py")
    }
    assert tracked, "git lists no Python file"
    assert sorted(tracked - checked) == []
