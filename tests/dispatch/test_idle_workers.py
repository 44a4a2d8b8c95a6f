"""Supervision of workers that owe results without working on them: stopped
while idle, or hung while starting up. With ``timeout_s`` set, each is found,
replaced, and its chunks re-sent: the output is exact."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.dispatch import timeouts
from centralpipe.dispatch.executors import procpool
from tests.fns import faulty

N = 200


def _loader(**kw: Any) -> cp.Loader[int]:
    cfg = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=2, start_method="fork", timeout_s=0.5, **kw)
    )
    return cp.Loader(cp.Pipeline.from_iterable(range(N)).dispatch().map(faulty.identity), cfg)


@pytest.mark.timeout(60)
def test_worker_stopped_while_idle_is_replaced(caplog: pytest.LogCaptureFixture) -> None:
    """A worker frozen (SIGSTOP) while waiting for work is sent a chunk it never
    starts: after ``timeout_s`` it is killed and replaced, and nothing is lost."""
    with _loader(buffer_size=2, chunk_size=1) as loader:
        it = iter(loader)
        got = [next(it) for _ in range(10)]
        time.sleep(0.5)  # both workers finish their (instant) items and wait for work
        frozen = loader.worker_pids()[0]
        os.kill(frozen, signal.SIGSTOP)
        try:
            with caplog.at_level(logging.WARNING, logger="centralpipe"):
                got.extend(it)
        finally:
            try:
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert got == list(range(N))
        assert loader.metrics()["dispatch"]["restarts"] == 1
        assert frozen not in loader.worker_pids()
    assert "hung for more than timeout_s=0.5" in caplog.text


def _hang_first_start(marker: str, real: Any, *args: Any) -> None:
    """``worker_main`` that hangs before its receive loop in the first worker
    started (the replacement starts normally)."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        real(*args)
        return
    os.close(fd)
    time.sleep(3600)


@pytest.mark.timeout(60)
def test_worker_hung_during_start_up_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker that never reaches its receive loop while it owes results is
    replaced after the start-up grace (here shortened to 1 s); output exact."""
    import functools

    marker = str(tmp_path / "hung")
    monkeypatch.setattr(
        procpool, "worker_main", functools.partial(_hang_first_start, marker, procpool.worker_main)
    )
    monkeypatch.setattr(timeouts, "STARTUP_GRACE_S", 1.0)
    with caplog.at_level(logging.WARNING, logger="centralpipe"), _loader(chunk_size=4) as loader:
        assert list(loader) == list(range(N))
        assert loader.metrics()["dispatch"]["restarts"] == 1
    assert "did not start within 1.0 s" in caplog.text
