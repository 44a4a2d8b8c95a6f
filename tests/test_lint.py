"""The code base stays ruff-clean, ruff-formatted and mypy-clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

COMMANDS = {
    "ruff-check": [sys.executable, "-m", "ruff", "check", "."],
    "ruff-format": [sys.executable, "-m", "ruff", "format", "--check", "."],
    "mypy": [sys.executable, "-m", "mypy"],
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(COMMANDS))
def test_linter_is_clean(name: str, tmp_path: Path) -> None:
    """ruff check, ruff format --check and mypy report nothing."""
    cmd = COMMANDS[name]
    if name == "mypy":
        cmd = [*cmd, "--cache-dir", str(tmp_path / "mypy")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
