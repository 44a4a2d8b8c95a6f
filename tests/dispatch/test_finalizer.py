"""The Loader's finalizer takes no lock: garbage collection may run it inside
one of the Loader's own threads while that thread holds one of its locks
(the feeder inside a central ``next()``, or in its bookkeeping); it returns
at once and everything still ends."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.dispatch import reorder
from tests.support.configs import loader_config

#: How long the finalizer may take before the test calls it a deadlock.
RETURN_S = 10.0


def _times2(x: int) -> int:
    return 2 * x


class FinalizeOnce:
    """Runs the loader's finalizer, once, in the thread that calls it, and
    records whether (and in which thread) it returned."""

    def __init__(self) -> None:
        self.loader: cp.Loader[Any] | None = None
        self.returned = threading.Event()
        self.thread = ""
        self.fired = False

    def fire(self) -> None:
        if self.fired or self.loader is None:
            return
        self.fired = True
        self.thread = threading.current_thread().name
        self.loader._central._finalizer()  # what garbage collection would call here
        self.returned.set()


def _no_threads_left(before: set[threading.Thread]) -> bool:
    """Every centralpipe thread started since ``before`` ends (within 10 s)."""
    for _ in range(100):
        alive = [
            t
            for t in threading.enumerate()
            if t.name.startswith("centralpipe-") and t not in before
        ]
        if not alive:
            return True
        alive[0].join(0.1)
    return False


@pytest.mark.timeout(60)
def test_finalizer_inside_a_central_next_in_the_feeder_thread() -> None:
    """The finalizer run by the feeder in the middle of a central stage's
    next() (holding the chain lock) returns; the loader's threads and
    workers then end."""
    before = set(threading.enumerate())
    probe = FinalizeOnce()

    def stage(x: int) -> int:
        if x == 5:
            probe.fire()
        return x

    pipe = cp.Pipeline.from_iterable(range(100)).map(stage).dispatch().map(_times2)
    loader = cp.Loader(pipe, loader_config(num_workers=2))
    probe.loader = loader
    try:
        loader._iter_started()  # the feeder starts pulling at once
        assert probe.returned.wait(RETURN_S), "the finalizer deadlocked in the feeder thread"
        assert probe.thread == "centralpipe-feeder"
        assert _no_threads_left(before)
        assert loader.worker_pids() == []
    finally:
        loader.close()


class _HighWater:
    """A ``StreamStats.high_water`` that runs the probe when the feeder sets
    it: inside the stream's bookkeeping lock."""

    probe: FinalizeOnce

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = "_" + name

    def __get__(self, obj: Any, owner: type) -> int:
        return int(obj.__dict__.get(self.name, 0))

    def __set__(self, obj: Any, value: int) -> None:
        obj.__dict__[self.name] = value
        if value and threading.current_thread().name == "centralpipe-feeder":
            self.probe.fire()


@pytest.mark.timeout(60)
def test_finalizer_inside_the_feeders_bookkeeping(monkeypatch: pytest.MonkeyPatch) -> None:
    """The finalizer run by the feeder while it holds a stream's bookkeeping
    lock returns; the loader's threads and workers then end."""
    before = set(threading.enumerate())
    probe = FinalizeOnce()
    descriptor = _HighWater()
    descriptor.probe = probe
    descriptor.__set_name__(reorder.StreamStats, "high_water")
    monkeypatch.setattr(reorder.StreamStats, "high_water", descriptor, raising=False)
    pipe = cp.Pipeline.from_iterable(range(100)).dispatch().map(_times2)
    loader = cp.Loader(pipe, loader_config(num_workers=2))
    probe.loader = loader
    try:
        loader._iter_started()
        assert probe.returned.wait(RETURN_S), "the finalizer deadlocked in the feeder thread"
        assert _no_threads_left(before)
        assert loader.worker_pids() == []
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_garbage_collected_loader_ends_its_workers() -> None:
    """A loader dropped mid-epoch (finalizer in the caller's thread) ends its
    workers and threads."""
    before = set(threading.enumerate())
    pipe = cp.Pipeline.from_iterable(range(1000)).dispatch().map(_times2)
    loader = cp.Loader(pipe, loader_config(num_workers=2))
    it = iter(loader)
    assert next(it) == 0
    pids = loader.worker_pids()
    assert len(pids) == 2
    del it, loader
    gc.collect()
    assert _no_threads_left(before)
