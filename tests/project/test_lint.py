"""The code base stays ruff-clean, ruff-formatted and mypy-clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

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


#: Private pieces of the standard library the transport once used: ctypes
#: pointer writes and CPython's ``Connection`` framing (``_recv_bytes``,
#: ``_send_bytes``, ``_recv``, ``_send``, ``_handle``).
PRIVATE_MODULES = {"ctypes", "_ctypes", "_multiprocessing", "_posixshmem"}
PRIVATE_ATTRIBUTES = {"_recv_bytes", "_send_bytes", "_recv", "_send", "_handle"}


def test_package_uses_only_public_ipc_apis() -> None:
    """No module of the package imports ctypes or multiprocessing's C helpers,
    or reaches into a ``Connection``'s private framing."""
    import ast

    found = []
    for path in sorted((ROOT / "centralpipe").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            bad = [n for n in names if n in PRIVATE_MODULES]
            if isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES:
                own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if not own:  # a method of our own may have such a name
                    bad.append(node.attr)
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in bad]
    assert not found, "\n".join(found)
