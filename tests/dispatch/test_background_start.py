"""Workers start in the background when the Loader is created (forkserver and
spawn): they are ready before the first pass, a Loader never iterated or
garbage-collected leaves nothing, a close during the start ends it, and a
failed start is raised by the first pass, which the next one retries."""

from __future__ import annotations

import errno
import gc
import threading
import time
from typing import Any

import psutil
import pytest

import centralpipe as cp
from centralpipe.dispatch.executors.procpool import ProcessPool
from tests.fns import startup_fns

#: Bound on waiting for the background start in these tests (a loaded machine
#: may take seconds to boot a forkserver).
START_WAIT_S = 60.0
METHODS = [pytest.param("forkserver", id="forkserver"), pytest.param("spawn", id="spawn")]


def _double(x: int) -> int:
    return 2 * x


def _loader(method: str, n: int = 12, workers: int = 2) -> cp.Loader[int]:
    """The default ``start_inline`` (off): every item runs on the workers."""
    pipe = cp.Pipeline.from_iterable(range(n)).dispatch().map(_double)
    config = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=workers, start_method=method, chunk_size=2)
    )
    return cp.Loader(pipe, config)


def _started_pids(loader: cp.Loader[Any]) -> list[int]:
    """Wait for the loader's background start to finish; the pids it started."""
    starter = loader._central._res.starter
    assert starter is not None, "a background start is under way"
    deadline = time.monotonic() + START_WAIT_S
    while not starter.done():
        assert time.monotonic() < deadline, "the background start did not finish"
        time.sleep(0.02)
    assert starter.error is None
    return [slot.process.pid for slot in starter.pool.slots]


def _gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + START_WAIT_S
    while any(psutil.pid_exists(p) and _running(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.parametrize("method", METHODS)
def test_workers_start_when_the_loader_is_created(method: str) -> None:
    """Creating the Loader starts its workers; they reach their receive loop
    before any iteration, and the first pass uses them (no second start)."""
    with _loader(method) as loader:
        pids = _started_pids(loader)
        assert len(pids) == 2 and all(_running(p) for p in pids)
        pool = loader._central._res.starter.pool  # type: ignore[union-attr]
        deadline = time.monotonic() + START_WAIT_S
        while not all(slot.ready() for slot in pool.slots):
            assert time.monotonic() < deadline, "the workers never became ready"
            time.sleep(0.02)
        assert loader.epoch == 0 and loader.worker_pids() == []
        assert list(loader) == [2 * i for i in range(12)]
        assert sorted(loader.worker_pids()) == sorted(pids)


@pytest.mark.parametrize("method", METHODS)
def test_loader_never_iterated_leaves_nothing(method: str) -> None:
    """A Loader closed without ever being iterated ends the workers it started."""
    loader = _loader(method)
    pids = _started_pids(loader)
    loader.close()
    assert _gone(pids)
    assert loader._central._res.starter is None


def test_garbage_collected_loader_ends_its_background_start() -> None:
    """A Loader that is never iterated nor closed, once garbage-collected, ends
    the workers its background start started (the thread holds no Loader)."""
    loader = _loader("forkserver")
    pids = _started_pids(loader)
    del loader
    gc.collect()
    assert _gone(pids)


def test_garbage_collected_during_the_start_leaves_nothing() -> None:
    """A Loader dropped at once, while its workers are still starting, leaves
    no process and no thread behind (the leak fixture checks)."""
    loader = _loader("forkserver")
    del loader
    gc.collect()


def test_close_during_the_background_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() while the first worker is starting waits for it, starts no
    other, and ends the one that started."""
    real = ProcessPool._start
    entered = threading.Event()
    started: list[int] = []

    def slow_start(self: ProcessPool, slot: Any) -> None:
        if slot.index == 0:
            entered.set()
            time.sleep(0.3)  # close() arrives meanwhile
        real(self, slot)
        started.append(slot.index)

    monkeypatch.setattr(ProcessPool, "_start", slow_start)
    loader = _loader("forkserver")
    assert entered.wait(START_WAIT_S)
    pool = loader._central._res.starter.pool  # type: ignore[union-attr]
    loader.close()
    assert started == [0], "the start stopped after the worker in progress"
    assert pool.shut and all(slot.process is None for slot in pool.slots)
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)


def test_failed_background_start_is_raised_by_the_first_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker start that fails in the background raises at the first next(),
    saying where it happened; nothing is left running, the epoch is not
    started, and the next pass starts the workers afresh. (Without the inline
    warm start, the default; with it, see test_warm_start.)"""
    real = ProcessPool._start

    def failing_start(self: ProcessPool, slot: Any) -> None:
        if slot.index == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        real(self, slot)

    monkeypatch.setattr(ProcessPool, "_start", failing_start)
    with _loader("forkserver") as loader:
        pool = loader._central._res.starter.pool  # type: ignore[union-attr]
        with pytest.raises(OSError, match="Too many open files") as info:
            next(iter(loader))
        assert any("in the background" in note for note in info.value.__notes__)
        assert pool.shut and loader.worker_pids() == []
        assert loader.epoch == 0 and loader._central._res.starter is None
        monkeypatch.undo()
        assert list(loader) == [2 * i for i in range(12)], "the retry starts afresh"
        assert loader.epoch == 1


def test_fork_workers_start_at_the_first_pass() -> None:
    """fork workers are not started in the background (forking from a thread
    while the caller runs is unsafe): nothing starts before the first pass."""
    with _loader("fork") as loader:
        assert loader._central._res.starter is None and loader._central._res.pool is None
        assert list(loader) == [2 * i for i in range(12)]


def test_late_torch_import_still_limits_its_threads() -> None:
    """A worker that needs no torch at start, whose function imports torch
    itself, gets torch's threads limited from its next message on (every
    item on the worker: no inline warm start)."""
    pipe = cp.Pipeline.from_iterable(range(6)).dispatch().map(startup_fns.torch_threads)
    config = cp.LoaderConfig(
        workers=cp.WorkerConfig(
            num_workers=1, start_method="spawn", chunk_size=1, start_inline=False
        )
    )
    with cp.Loader(pipe, config) as loader:
        threads = list(loader)
    assert threads[-1] == 1, threads
