"""Races the dispatch design rules out, each made to happen deterministically:
a worker's status read in the middle of its write, the reader count
changed by several threads, Ctrl-C while the consumer waits for a result,
and ``worker_states()`` while a worker's output pipe is full."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.dispatch import sender
from centralpipe.dispatch.executors.procpool import ProcessPool
from centralpipe.dispatch.reorder import Stream
from centralpipe.dispatch.wire import protocol
from centralpipe.dispatch.wire.protocol import (
    STATUS_LEN,
    STATUS_SEQ,
    STATUS_STARTED,
    STATUS_VERSION,
    read_status,
    status_begin,
)
from centralpipe.testing import collect
from tests.support.configs import loader_config


def _times2(x: int) -> int:
    return 2 * x


# -- a worker's busy status is never read torn ---------------------------------


class WrittenDuringRead(list[float]):
    """A status array whose worker moves to item ``seq`` (a whole write,
    version bumps included) just after the reader's ``at``-th access."""

    def __init__(self, at: int, seq: int, started: float) -> None:
        super().__init__([0.0] * STATUS_LEN)
        self.at, self.reads = 0, 0
        status_begin(self, stream=0, seq=1, stage=0)
        self[STATUS_STARTED] = 100.0  # item 1 started long ago
        self.at, self.seq, self.started = at, seq, started
        self.reads = 0

    def __getitem__(self, i: Any) -> Any:
        value = super().__getitem__(i)
        self.reads += 1
        if self.at and self.reads == self.at:
            status_begin(self, stream=0, seq=self.seq, stage=0)
            list.__setitem__(self, STATUS_STARTED, self.started)
        return value


@pytest.mark.parametrize("at", range(1, 6), ids=lambda a: f"write-after-read-{a}")
def test_busy_status_is_never_read_torn(at: int) -> None:
    """A worker that moves to its next item while the main process reads its
    status gives the old item or the new one, never the new seq with the old
    start time (which would time out a healthy worker and blame that item)."""
    status = WrittenDuringRead(at, seq=2, started=200.0)
    busy = read_status(status)
    assert busy is not None
    _, seq, _, started = busy
    assert (seq, started) in {(1, 100.0), (2, 200.0)}


def test_a_status_read_waits_out_a_write_in_progress() -> None:
    """An odd version (the worker is mid-write) is not read as a status."""
    status = [0.0] * STATUS_LEN
    status_begin(status, stream=0, seq=7, stage=0)
    status[STATUS_VERSION] += 1  # a write begun...
    status[STATUS_SEQ] = 8  # ...and half done
    assert read_status(status) is None


# -- the reader count --------------------------------------------------------------


class OwnedLock:
    """A lock that knows which thread holds it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None

    def __enter__(self) -> None:
        self._lock.acquire()
        self.owner = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        self.owner = None
        self._lock.release()


def test_the_reader_count_changes_only_under_its_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every change of a stream's reader count (which the central thread reads
    to yield the chain lock) is made by the thread holding its lock, so
    concurrent readers never lose an update."""
    writes: list[bool] = []

    def get(self: Stream) -> int:
        return int(self.__dict__.get("_readers_value", 0))

    def set_(self: Stream, value: int) -> None:
        lock = self.__dict__.get("readers_lock")
        writes.append(isinstance(lock, OwnedLock) and lock.owner == threading.get_ident())
        self.__dict__["_readers_value"] = value

    monkeypatch.setattr(Stream, "waiting_readers", property(get, set_), raising=False)
    # A source's query waits for the chain lock (a count's reads its live view).
    pipe = cp.Pipeline.from_iterable(range(50), name="src").count("c").dispatch().map(_times2)
    with cp.Loader(pipe, loader_config(num_workers=2)) as loader:
        it = iter(loader)
        next(it)
        stream = loader._central._res.run.stream  # type: ignore[union-attr]
        stream.readers_lock = OwnedLock()  # type: ignore[assignment]
        writes.clear()
        threads = [threading.Thread(target=lambda: loader.query("src")) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert writes and all(writes)
        assert stream.waiting_readers == 0
        assert list(it) == [2 * i for i in range(1, 50)]


# -- Ctrl-C while the consumer waits for a result ---------------------------------


@pytest.mark.timeout(60)
def test_ctrl_c_while_waiting_for_a_result_replaces_no_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C while the consumer waits for a result is re-raised at once: no
    worker is joined or replaced (the consumer never reads a worker's pipe, so
    no message is cut in half), and the checkpoint taken then resumes exactly."""
    real_recv = protocol.recv
    main_pid = os.getpid()
    consumer_reads: list[int] = []

    def recv(conn: Any) -> Any:
        in_consumer = threading.current_thread() is threading.main_thread()
        if in_consumer and os.getpid() == main_pid and not consumer_reads:  # not a worker
            consumer_reads.append(1)
            raise KeyboardInterrupt  # Ctrl-C in the middle of reading a message
        return real_recv(conn)

    monkeypatch.setattr(protocol, "recv", recv)
    real_take = sender._take_head
    waits: list[int] = []

    def take_head(s: Any) -> Any:
        done, head = real_take(s)
        if not done and threading.current_thread() is threading.main_thread():
            waits.append(1)
            if len(waits) == 3:
                raise KeyboardInterrupt  # Ctrl-C while waiting for the head result
        return done, head

    monkeypatch.setattr(sender, "_take_head", take_head)
    starts: list[int] = []
    real_start = ProcessPool._start

    def start(self: ProcessPool, slot: Any) -> None:
        starts.append(slot.index)
        real_start(self, slot)

    monkeypatch.setattr(ProcessPool, "_start", start)
    pipe = cp.Pipeline.from_iterable(range(40)).dispatch().map(_slow_times2)
    config = loader_config(num_workers=2, chunk_size=1, buffer_size=4)
    with cp.Loader(pipe, config) as loader:
        it = iter(loader)
        got = []
        with pytest.raises(KeyboardInterrupt):
            while True:
                got.append(next(it))
        assert starts == [0, 1]  # the first start only: nothing joined or replaced
        assert consumer_reads == []  # the consumer never reads a worker's pipe
        assert loader.metrics()["dispatch"]["restarts"] == 0
        pids = loader.worker_pids()
        assert len(pids) == 2
        sd = loader.state_dict()
        loader.load_state_dict(sd)
        rest = collect(loader)
        assert loader.worker_pids() == pids
    assert got + rest == [2 * i for i in range(40)]


def _slow_times2(x: int) -> int:
    time.sleep(0.01)
    return 2 * x


# -- worker_states() while a worker's output pipe is full -------------------------

MIB = 1 << 20


class BigOutputs:
    """A stateful worker stage whose outputs (1 MiB each) fill its pipe."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, item: bytes) -> bytes:
        self.calls += 1
        return bytes(MIB)

    def state_dict(self) -> dict[str, int]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = state["calls"]


def _mib(i: int) -> bytes:
    return bytes(MIB)


@pytest.mark.timeout(90)
def test_worker_states_mid_run_with_a_full_output_pipe() -> None:
    """worker_states() while the consumer has stopped reading and the worker's
    input and output pipes are full does not deadlock: the supervisor keeps
    reading results, and the answer comes back."""
    n = 32
    pipe = cp.Pipeline.from_iterable(range(n)).map(_mib).dispatch().map(BigOutputs(), name="big")
    config = loader_config(num_workers=1, chunk_size=1, buffer_size=None)
    with cp.Loader(pipe, config) as loader:
        it = iter(loader)
        next(it)
        time.sleep(0.5)  # let the feeder fill the worker's input, and it its output
        states = loader.worker_states()
        assert len(states) == 1
        assert 1 <= states[0]["big"]["calls"] <= n
        assert sum(1 for _ in it) == n - 1
