"""One reader of the workers at a time: a run whose stop was cut short
(Ctrl-C inside ``Supervisor.stop()``, before its supervisor thread was told to
stop) is stopped for good by the next pass of the same Loader before that
pass starts. A supervisor thread left running would read the new run's
results and drop them as another run's, and the new run would wait for them
forever. Both ways a thread can outlive its run's stop are provoked: the
stop cut short, and the stop giving up the wait for the thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.dispatch import supervisor, timeouts
from centralpipe.dispatch.executors.pool import Event, Executor
from centralpipe.dispatch.executors.procpool import ProcessPool
from centralpipe.dispatch.executors.threadpool import ThreadPool
from centralpipe.testing import collect
from tests.support.configs import loader_config

N = 120


def _times2(x: int) -> int:
    return 2 * x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("executor", ["process", "thread"])
def test_a_run_whose_stop_was_cut_short_reads_nothing_of_the_next_run(
    executor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a stop cut short by Ctrl-C, the next pass delivers every item and
    the earlier run's supervisor thread ends (it reads no result of the new run)."""
    real_stop = supervisor.Supervisor.stop
    cut: list[supervisor.Supervisor] = []

    def stop_cut_short(self: supervisor.Supervisor, *args: Any, **kwargs: Any) -> None:
        if not cut:
            # As a SIGINT landing right after the run is abandoned, before
            # the supervisor thread is told to stop.
            cut.append(self)
            self.abandoned = True
            self.executor.set_run(self.run_id + 1)
            raise KeyboardInterrupt
        real_stop(self, *args, **kwargs)

    monkeypatch.setattr(supervisor.Supervisor, "stop", stop_cut_short)
    pipe = cp.Pipeline.from_iterable(range(N)).dispatch().map(_times2)
    config = loader_config(num_workers=2, buffer_size=16, chunk_size=4, executor=executor)
    expected = [2 * i for i in range(N)]
    with cp.Loader(pipe, config) as loader:
        it = iter(loader)
        assert [next(it) for _ in range(5)] == expected[:5]
        with pytest.raises(KeyboardInterrupt):
            iter(loader)  # a new pass stops the one in progress: cut short
        assert cut
        old: threading.Thread = cut[0].thread
        assert collect(loader) == expected
        old.join(10.0)
        assert not old.is_alive(), "the cut-short run's supervisor still reads the workers"
        assert collect(loader) == expected


def _results_ready(pool: Executor) -> bool:
    if isinstance(pool, ProcessPool):
        return any(s.conn is not None and s.conn.poll(0) for s in pool.slots)
    assert isinstance(pool, ThreadPool)
    return pool.outbox.qsize() > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("executor", ["process", "thread"])
def test_a_supervisor_that_outlived_its_stop_reads_nothing_of_the_next_run(
    executor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's supervisor thread that its stop gave up waiting for (as on a
    loaded machine), and that waits on the workers again only once the next
    run's results are ready, takes none of them: the next pass delivers every
    item, and the old thread ends."""
    pool_cls: type[ProcessPool | ThreadPool] = ProcessPool if executor == "process" else ThreadPool
    real_wait = pool_cls.wait
    armed = threading.Event()
    held = threading.Event()  # the old thread is stopped before its wait
    release = threading.Event()
    old_done = threading.Event()  # the old thread's wait has returned
    old: list[threading.Thread] = []
    pools: list[Executor] = []

    def wait(
        self: Any, timeout: float, paused: frozenset[int] = frozenset(), reader: object = None
    ) -> list[Event]:
        me = threading.current_thread()
        if armed.is_set() and not old:
            old.append(me)
            pools.append(self)
        if old and me is old[0] and not old_done.is_set():
            held.set()
            assert release.wait(30)
            try:
                return real_wait(self, timeout, paused, reader)
            finally:
                old_done.set()
        if old and not old_done.is_set():
            # The new run's thread lets the old one look first.
            assert old_done.wait(30)
        return real_wait(self, timeout, paused, reader)

    monkeypatch.setattr(pool_cls, "wait", wait)
    pipe = cp.Pipeline.from_iterable(range(N)).dispatch().map(_times2)
    config = loader_config(num_workers=2, buffer_size=16, chunk_size=4, executor=executor)
    expected = [2 * i for i in range(N)]
    with cp.Loader(pipe, config) as loader:
        it = iter(loader)
        assert [next(it) for _ in range(5)] == expected[:5]
        armed.set()
        assert held.wait(10)
        # The stop gives up waiting for the held thread at once.
        bound = timeouts.STOP_TIMEOUT_S
        timeouts.STOP_TIMEOUT_S = 0.05
        try:
            it = iter(loader)
        finally:
            timeouts.STOP_TIMEOUT_S = bound

        def release_when_ready() -> None:
            # The new pass's first next() starts it; its results wait unread.
            deadline = time.monotonic() + 20
            while not _results_ready(pools[0]) and time.monotonic() < deadline:
                time.sleep(0.001)
            release.set()

        releaser = threading.Thread(target=release_when_ready)
        releaser.start()
        assert list(it) == expected
        releaser.join(10.0)
        assert old_done.is_set()
        old[0].join(10.0)
        assert not old[0].is_alive()
        assert collect(loader) == expected
