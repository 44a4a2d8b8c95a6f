"""Workers exit within about a second of the main process's abrupt death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support.leaks import alive

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "orphan_main.py"
#: Bound on how long workers outlive the main process (typically well under 1 s;
#: the margin is for a loaded machine).
EXIT_WITHIN_S = 5.0


def _state(pid: int) -> str | None:
    try:
        status: str = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return None
    return status


@pytest.mark.parametrize(
    ("start_method", "mode"),
    [("fork", "gil"), ("forkserver", "gil"), ("fork", "thread")],
    ids=["fork-gil-held", "forkserver-gil-held", "fork-started-by-a-thread"],
)
def test_workers_exit_when_main_is_killed_and_unreaped(start_method: str, mode: str) -> None:
    """SIGKILL of the main process, left a zombie: its workers exit within ~1 s,
    even inside a C call that holds the GIL."""
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), start_method, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert pids, f"no worker pids printed; stderr: {proc.stderr.read() if proc.stderr else ''}"
        # The main process is dead but not reaped: we, its parent, do not wait yet.
        deadline = time.monotonic() + 10
        while alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(proc.pid) is not None and not alive(proc.pid), "main is a zombie"
        died = time.monotonic()
        while any(alive(p) for p in pids) and time.monotonic() - died < 10:
            time.sleep(0.02)
        lived = time.monotonic() - died
        assert not any(alive(p) for p in pids), f"workers {pids} outlived the main by {lived:.1f} s"
        assert lived < EXIT_WITHIN_S, f"workers outlived the main process by {lived:.2f} s"
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        proc.wait(10)
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()


def test_liveness_check_sees_a_zombie_as_dead() -> None:
    """The watchdog's check counts an exited, unreaped process as dead."""
    from centralpipe.dispatch.worker.loop import main_alive

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(proc.pid) is not None, "still unreaped"
        assert not main_alive(proc.pid)
        assert main_alive(os.getpid())
    finally:
        proc.wait(10)
    assert not main_alive(proc.pid)
