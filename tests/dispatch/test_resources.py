"""Resources of worker restarts: no fd per restart, no pipe left by a failed
start, no closed process object touched after a failed replacement."""

from __future__ import annotations

import errno
import gc
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

import centralpipe as cp
from tests.fns import faulty

#: How long a test waits for the supervisor to replace a killed worker.
REPLACE_WAIT_S = 10.0


def _fds() -> int:
    gc.collect()
    return psutil.Process().num_fds()


def _loader(n: int, *, workers: int = 1, **kw: Any) -> cp.Loader[int]:
    kw.setdefault("start_method", "fork")
    cfg = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=workers, **kw))
    return cp.Loader(cp.Pipeline.from_iterable(range(n)).dispatch().map(faulty.identity), cfg)


def _consume_until_replaced(
    loader: cp.Loader[int], it: Iterator[int], got: list[int], restarts: int, old_pid: int
) -> None:
    """Consume items until the loader counted ``restarts`` and a new worker runs."""
    deadline = time.monotonic() + REPLACE_WAIT_S
    while time.monotonic() < deadline:
        got.append(next(it))
        pids = loader.worker_pids()
        if loader.metrics()["dispatch"]["restarts"] >= restarts and pids and old_pid not in pids:
            return
    pytest.fail(f"worker {old_pid} was not replaced within {REPLACE_WAIT_S} s")


def test_fds_stay_flat_after_fifty_worker_kills() -> None:
    """50 kills from outside: the main process's open fds do not grow with restarts."""
    n = 100_000
    with _loader(n, buffer_size=8, chunk_size=2, max_restarts=1000) as loader:
        it = iter(loader)
        got = [next(it) for _ in range(10)]
        counts = []
        for k in range(55):
            if k == 5:
                counts.append(_fds())
            pid = loader.worker_pids()[0]
            os.kill(pid, signal.SIGKILL)
            _consume_until_replaced(loader, it, got, k + 1, pid)
        counts.append(_fds())
        assert counts[1] - counts[0] <= 3, f"fds after 5 and after 55 kills: {counts}"
        got.extend(next(it) for _ in range(20))
        assert got == list(range(len(got)))
        assert loader.metrics()["dispatch"]["restarts"] == 55


class _StartFails:
    """Makes the ``fail_at``-th and later starts of fork workers raise EMFILE."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_at: int) -> None:
        self.starts = 0
        ctx = multiprocessing.get_context("fork")
        real = type(ctx).Process
        outer = self

        class Process(real):  # type: ignore[misc, valid-type]
            def start(self) -> None:
                outer.starts += 1
                if outer.starts >= fail_at:
                    raise OSError(errno.EMFILE, "Too many open files (injected)")
                super().start()

        monkeypatch.setattr(type(ctx), "Process", Process)


@pytest.mark.parametrize("fail_at", [1, 2], ids=["first-worker", "second-worker"])
def test_failed_start_leaves_no_pipe_end_open(
    monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    """A worker start that raises (EMFILE) closes both ends of its pipes, even
    while the caller still holds the exception."""
    loader = _loader(50, workers=2)
    before = _fds()
    _StartFails(monkeypatch, fail_at)
    with pytest.raises(OSError, match="injected") as excinfo:
        next(iter(loader))
    assert _fds() == before, "pipe ends left open by the failed start"
    del excinfo
    monkeypatch.undo()
    assert list(loader) == list(range(50)), "the next pass starts the workers afresh"
    loader.close()


def test_failed_replacement_is_a_clear_error_and_the_loader_stays_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replacement whose start raises ends the pass with a WorkerError naming
    the worker and the cause; nothing touches the closed process afterwards:
    metrics, worker_pids, state_dict and close work, and a resume is exact."""
    loader = _loader(400, workers=2, buffer_size=16, chunk_size=2)
    it = iter(loader)
    got = [next(it) for _ in range(20)]
    _StartFails(monkeypatch, 1)  # every start from now on fails
    pid = loader.worker_pids()[0]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(cp.WorkerError, match="could not start a replacement") as excinfo:
        got.extend(it)
    assert isinstance(excinfo.value.__cause__, OSError)
    assert "worker 0" in str(excinfo.value)
    loader.metrics()
    assert pid not in loader.worker_pids()
    state = loader.state_dict()
    monkeypatch.undo()
    loader.close()
    with _loader(400, workers=2, buffer_size=16, chunk_size=2) as again:
        again.load_state_dict(state)
        got.extend(again)
    assert got == list(range(400))
