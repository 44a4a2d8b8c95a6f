"""The supervisor knows an executor by its interface: how a dead worker ended
(its exit status, and what to check when it died starting up) comes from the
executor, not from a test of the executor's class."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.dispatch.executors import procpool
from centralpipe.dispatch.executors.pool import Executor, Slot
from centralpipe.dispatch.executors.threadpool import ThreadPool
from centralpipe.dispatch.wire.ringwriter import receive_ring
from centralpipe.dispatch.worker.loop import WorkerSpec
from tests.fns import faulty

N = 40
FORK_HINT = (
    " while starting up (start method 'fork'; with forkserver or spawn the main script must "
    'be guarded by `if __name__ == "__main__":` and stage functions importable)'
)


def _die_at_first_chunk(marker: str, real: Callable[..., None], *args: Any) -> None:
    """``worker_main`` whose first worker, once a chunk is waiting on its pipe,
    exits with status 3 before its receive loop (so before it is ready, while it
    owes that chunk); the replacement starts normally."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        real(*args)
        return
    os.close(fd)
    conn, with_ring = args[1], len(args) > 7 and args[7]
    if with_ring:  # the ring comes first on the pipe
        receive_ring(conn)
    conn.poll(30)
    os._exit(3)


@pytest.mark.timeout(60)
def test_a_worker_that_dies_starting_up_is_named_with_its_exit_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A process worker that exits before it is ready is replaced, logged with
    its exit status and the start-up hint of its start method; output exact
    (one item per chunk: both workers are sent work)."""
    marker = str(tmp_path / "dies")
    patched = functools.partial(_die_at_first_chunk, marker, procpool.worker_main)
    monkeypatch.setattr(procpool, "worker_main", patched)
    workers = cp.WorkerConfig(num_workers=2, chunk_size=1, start_method="fork")
    cfg = cp.LoaderConfig(workers=workers)
    pipe = cp.Pipeline.from_iterable(range(N)).dispatch().map(faulty.identity)
    with caplog.at_level(logging.WARNING, logger="centralpipe"), cp.Loader(pipe, cfg) as loader:
        assert list(loader) == list(range(N))
        assert loader.metrics()["dispatch"]["restarts"] == 1
    assert f"died (exit code 3){FORK_HINT}" in caplog.text


def _spec() -> WorkerSpec:
    return WorkerSpec([], main_pid=os.getpid())


@pytest.mark.parametrize(
    ("make", "hint"),
    [
        pytest.param(lambda: ThreadPool(1, _spec()), "", id="threads"),
        pytest.param(lambda: procpool.ProcessPool(1, _spec(), "fork"), FORK_HINT, id="processes"),
    ],
)
def test_an_executor_says_how_its_workers_end(make: Callable[[], Executor], hint: str) -> None:
    """Every executor answers the supervisor's two questions: the exit status
    of a slot's worker (none for a slot never started) and the start-up hint."""
    executor = make()
    try:
        slot = executor.slots[0]
        assert isinstance(slot, Slot)
        assert executor.exitcode(slot) is None
        assert executor.startup_death_text() == hint
    finally:
        executor.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("executor", "has_transport"), [("process", True), ("thread", False)], ids=["process", "thread"]
)
def test_metrics_report_transport_bytes_as_the_executor_counts_them(
    executor: str, has_transport: bool
) -> None:
    """``metrics()["dispatch"]["transport"]`` is what the executor counts
    (``Executor.transport_bytes``): the three byte counts for worker
    processes, absent for threads, which hand results over as objects."""
    pipe = cp.Pipeline.from_iterable(range(20)).dispatch().map(abs)
    config = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=1, executor=executor, start_method="fork")
    )
    with cp.Loader(pipe, config) as loader:
        assert list(loader) == list(range(20))
        dispatch = loader.metrics()["dispatch"]
    if has_transport:
        assert sorted(dispatch["transport"]) == [
            "pipe_bytes",
            "shared_memory_bytes",
            "shared_memory_lent_bytes",
        ]
        assert all(isinstance(v, int) and v >= 0 for v in dispatch["transport"].values())
    else:
        assert "transport" not in dispatch
