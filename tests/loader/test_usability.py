"""Errors that say what to do: `.count(len)`, stage functions in an unimportable `__main__`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import centralpipe as cp

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import centralpipe as cp

def double(x):
    return 2 * x

pipe = cp.Pipeline.from_iterable(range(6)).dispatch().map(double)
config = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=1, start_method={method!r}))
try:
    with cp.Loader(pipe, config) as loader:
        print("items", list(loader))
except cp.PipelineError as exc:
    print("PipelineError", exc)
"""


def test_count_with_a_function_as_name_hints_weight_fn() -> None:
    """`.count(len)` raises `PipelineError` pointing to `weight_fn=len`."""
    with pytest.raises(cp.PipelineError, match=r"weight_fn=len"):
        cp.Pipeline.from_iterable([1]).count(len)  # type: ignore[arg-type]


def _run_c(method: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(method=method)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_main_functions_of_python_c_are_refused_up_front(method: str) -> None:
    """A stage function in `__main__` of `python -c` with forkserver/spawn is a `PipelineError`
    suggesting fork or a module, before any worker starts."""
    out = _run_c(method)
    assert out.startswith("PipelineError stage 'map_2'"), out
    assert "start_method='fork'" in out
    assert "define the function in a module" in out


def test_main_functions_of_python_c_run_with_fork() -> None:
    """The same `python -c` script works with fork, which needs no import."""
    assert _run_c("fork").strip() == "items [0, 2, 4, 6, 8, 10]"


SCRIPT_FILE = """
import centralpipe as cp


def double(x):
    return 2 * x


if __name__ == "__main__":
    pipe = cp.Pipeline.from_iterable(range(6)).dispatch().map(double)
    config = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=1, start_method="spawn"))
    with cp.Loader(pipe, config) as loader:
        print("items", list(loader))
"""


def test_main_functions_of_a_script_file_are_accepted(tmp_path: Path) -> None:
    """A script run as `python script.py` has an importable `__main__`: no error."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT_FILE)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.strip() == "items [0, 2, 4, 6, 8, 10]", proc.stdout + proc.stderr[-3000:]
