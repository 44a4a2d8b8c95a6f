"""Ctrl-C (KeyboardInterrupt) landing inside the dispatch path: pulling a
chunk from the central chain, stamping an item, running the worker stages
inline, sending a chunk to a worker (also a re-send), retiring a chunk,
starting and closing the pool. Wherever it lands it is raised at once, in the
``next()`` (or ``close()``) where it landed; the same iterator then goes on
with exactly the remaining items, a checkpoint taken then resumes exactly in
a fresh loader, and nothing is left open.

Each point is hit deterministically: a function patched to raise once, or a
trace hook that raises at the entry of the k-th function of centralpipe's
code that a call runs (as :mod:`centralpipe.testing.faults` does for the soak), swept
over every k of that call.
"""

from __future__ import annotations

import functools
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import psutil
import pytest

import centralpipe as cp
from centralpipe.dispatch import sender
from centralpipe.dispatch.budget import ResultBytes
from centralpipe.dispatch.executors.procpool import ProcessPool
from centralpipe.dispatch.reorder import Stream
from centralpipe.dispatch.wire import protocol, ringreader
from centralpipe.dispatch.worker.chain import WorkerChain
from centralpipe.testing import collect, faults
from tests.support.configs import loader_config

N = 120


def _times2(x: int) -> int:
    return 2 * x


class Flaky(Sequence[int]):
    """A sequence whose ``[at]`` raises KeyboardInterrupt once, before it
    hands anything out (the source's position does not move)."""

    def __init__(self, n: int, at: int) -> None:
        self.n = n
        self.at = at
        self.fired = False
        #: The ``next()`` call (see :class:`Calls`) the interrupt landed in.
        self.landed_in = -1
        self.calls: Calls | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:  # type: ignore[override]
        if i == self.at and not self.fired:
            self.fired = True
            self.landed_in = self.calls.n if self.calls is not None else -1
            raise KeyboardInterrupt
        if not 0 <= i < self.n:
            raise IndexError(i)
        return i


class Calls:
    """Counts the consumer's ``next()`` calls."""

    def __init__(self) -> None:
        self.n = 0

    def next(self, it: Iterator[Any]) -> Any:
        self.n += 1
        return next(it)


KINDS = {
    # inline, worker stages run by the consumer; count: stamped, item by item
    "inline-stamped": (0, lambda src: src.count("c").dispatch().map(_times2)),
    # inline, no stamps: the source hands out items in bulk (pull_into)
    "inline-bulk": (0, lambda src: src.dispatch().map(_times2)),
    # a parallel stage driven by the consumer (no worker stage after dispatch)
    "segment": (2, lambda src: src.map(_times2, parallel=True).dispatch()),
    "segment-stamped": (2, lambda src: src.count("c").map(_times2, parallel=True).dispatch()),
}


def _pipe(kind: str, source: Any) -> cp.Pipeline:
    return KINDS[kind][1](cp.Pipeline.from_iterable(source))


def _config(kind: str) -> cp.LoaderConfig:
    return loader_config(num_workers=KINDS[kind][0], buffer_size=32, chunk_size=8)


def _interrupted(loader: cp.Loader[Any], calls: Calls) -> tuple[Iterator[Any], list[Any]]:
    """Iterate until the KeyboardInterrupt; the iterator and the items before."""
    it = iter(loader)
    got: list[Any] = []
    while True:
        try:
            got.append(calls.next(it))
        except KeyboardInterrupt:
            return it, got
        except StopIteration:  # pragma: no cover - the interrupt never surfaced
            raise AssertionError("the KeyboardInterrupt was swallowed") from None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("at", [0, 5, 37, N - 1])
def test_ctrl_c_in_the_central_chain_is_raised_at_once_and_the_pass_goes_on(
    kind: str, at: int
) -> None:
    """A KeyboardInterrupt from the central chain while a chunk is filled is
    raised in that same next(); the same iterator then delivers exactly the
    rest, and the checkpoint taken then resumes exactly in a fresh loader."""
    expected = [2 * i for i in range(N)]
    flaky, calls = Flaky(N, at), Calls()
    flaky.calls = calls
    with cp.Loader(_pipe(kind, flaky), _config(kind)) as loader:
        it, got = _interrupted(loader, calls)
        assert flaky.fired and flaky.landed_in == calls.n  # raised at once
        sd = loader.state_dict()
        rest = list(it)
        assert got + rest == expected
        assert loader.state_dict()["finished"] is True
    with cp.Loader(_pipe(kind, Flaky(N, -1)), _config(kind)) as fresh:
        fresh.load_state_dict(sd)
        assert got + collect(fresh) == expected


def _once_at(real: Callable[..., Any], nth: int, after: bool = False) -> Callable[..., Any]:
    """``real`` raising KeyboardInterrupt at its ``nth`` call, before (or
    after) doing its work."""
    count = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        if count[0] != nth:
            return real(*args, **kwargs)
        if after:
            real(*args, **kwargs)
        raise KeyboardInterrupt

    return wrapper


def _interrupted_next_goes_on(
    k: int, loader: cp.Loader[Any], it: Iterator[Any], got: list[Any], expected: list[Any]
) -> tuple[bool, dict[str, Any], int]:
    """An interrupt at event ``k`` of the next ``next()``; the same iterator
    then gives exactly the rest. Whether it landed, and the checkpoint taken
    right after it with the count of items delivered by then."""
    landed = _interrupt_at(k, lambda: got.append(next(it)))
    sd, at = loader.state_dict(), len(got)
    got.extend(it)
    assert got == expected, f"interrupt at event {k}"
    return landed, sd, at


def _check_continue_and_resume(
    kind: str, monkeypatch: pytest.MonkeyPatch, patch: Callable[[], None]
) -> tuple[list[Any], cp.Loader[Any]]:
    expected = [2 * i for i in range(N)]
    calls = Calls()
    loader: cp.Loader[Any] = cp.Loader(_pipe(kind, range(N)), _config(kind))
    try:
        patch()
        it, got = _interrupted(loader, calls)
        sd = loader.state_dict()
        rest = list(it)
        monkeypatch.undo()
        assert got + rest == expected
    finally:
        loader.close()
    with cp.Loader(_pipe(kind, range(N)), _config(kind)) as fresh:
        fresh.load_state_dict(sd)
        assert got + collect(fresh) == expected
    return got, loader


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nth", [1, 2, 9, 30])
@pytest.mark.parametrize("kind", ["inline-stamped", "segment-stamped"])
def test_ctrl_c_at_the_stamp_of_a_pulled_item(
    monkeypatch: pytest.MonkeyPatch, kind: str, nth: int
) -> None:
    """Interrupted between pulling an item and stamping it: the item stays in
    its chunk with the right stamp (delivered counts stay exact)."""

    def patch() -> None:
        monkeypatch.setattr(Stream, "stamp_now", _once_at(Stream.stamp_now, nth))

    expected = [2 * i for i in range(N)]
    calls = Calls()
    with cp.Loader(_pipe(kind, range(N)), _config(kind)) as loader:
        patch()
        it, got = _interrupted(loader, calls)
        monkeypatch.undo()
        assert loader.query("c", delivered=True)["items"] == len(got)
        sd = loader.state_dict()
        rest = []
        for x in it:
            rest.append(x)
            assert loader.query("c", delivered=True)["items"] == len(got) + len(rest)
        assert got + rest == expected
    with cp.Loader(_pipe(kind, range(N)), _config(kind)) as fresh:
        fresh.load_state_dict(sd)
        assert got + collect(fresh) == expected
        assert fresh.query("c", delivered=True)["items"] == N


@pytest.mark.timeout(60)
@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("nth", [1, 3])
def test_ctrl_c_in_the_inline_worker_stages(
    monkeypatch: pytest.MonkeyPatch, nth: int, after: bool
) -> None:
    """Interrupted while the consumer runs the worker stages of a chunk: the
    next next() runs that chunk (not a new one), nothing lost or repeated."""

    def patch() -> None:
        monkeypatch.setattr(WorkerChain, "run_chunk", _once_at(WorkerChain.run_chunk, nth, after))

    _check_continue_and_resume("inline-stamped", monkeypatch, patch)


RETIRE_POINTS = [
    pytest.param("inline-stamped", "retire", id="inline-retire"),
    pytest.param("segment", "retire", id="segment-retire"),
    pytest.param("segment", "release-after", id="segment-bytes-released"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nth", [1, 4])
@pytest.mark.parametrize(("kind", "point"), RETIRE_POINTS)
def test_ctrl_c_while_a_chunk_is_retired(
    monkeypatch: pytest.MonkeyPatch, kind: str, point: str, nth: int
) -> None:
    """Interrupted while a delivered chunk is retired (at its start, or once
    its result bytes were released): it is retired once, whole, by the next
    next(); no item lost or repeated, no byte or item left counted."""
    if point == "retire":
        monkeypatch.setattr(Stream, "_retire", _once_at(Stream._retire, nth))
    else:
        monkeypatch.setattr(ResultBytes, "release", _once_at(ResultBytes.release, nth, True))
    expected = [2 * i for i in range(N)]
    with cp.Loader(_pipe(kind, range(N)), _config(kind)) as loader:
        it, got = _interrupted(loader, Calls())
        rest = list(it)
        monkeypatch.undo()
        assert got + rest == expected
        run = loader._central._res.run
        assert run is not None and run.stream.in_flight == 0
        if run.session is not None:
            assert run.session.held.held == 0
            assert all(s.in_flight == 0 for s in run.session.streams)


def _kill_once(x: int, marker: str, kill: bool) -> int:
    """With ``kill``, SIGKILLs its worker on item 20, once (``marker``)."""
    if kill and x == 20:
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return 2 * x
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)
    return 2 * x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["before-write", "half-written", "re-send"])
def test_ctrl_c_in_a_send_to_a_worker(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, how: str
) -> None:
    """Interrupted while the consumer (running a parallel stage) sends a
    chunk — before writing, with half the message written, or re-sending a
    dead worker's chunk: the chunk is still sent (a worker that may hold
    half a message is replaced), nothing lost or repeated."""
    fn = functools.partial(_kill_once, marker=str(tmp_path / "killed"), kill=how == "re-send")
    pipe = cp.Pipeline.from_iterable(range(N)).map(fn, parallel=True).dispatch()
    config = _config("segment")
    expected = [2 * i for i in range(N)]
    real_send, real_chunk = protocol.send_encoded, sender.send_chunk
    sends: list[int] = []

    def send_encoded(conn: Any, message: Any) -> None:
        sends.append(1)
        if len(sends) == 3:  # the third chunk sent
            if how == "half-written":
                conn.send_bytes(message.head)
            raise KeyboardInterrupt
        real_send(conn, message)

    def send_chunk(session: Any, s: Any, chunk: Any) -> None:
        if not sends and chunk.sent_gen >= 0:  # a dead worker's chunk, sent again
            sends.append(1)
            raise KeyboardInterrupt
        real_chunk(session, s, chunk)

    with cp.Loader(pipe, config) as loader:
        if how == "re-send":
            monkeypatch.setattr(sender, "send_chunk", send_chunk)
        else:
            monkeypatch.setattr(protocol, "send_encoded", send_encoded)
        it, got = _interrupted(loader, Calls())
        assert sends
        sd = loader.state_dict()
        rest = list(it)
        monkeypatch.undo()
        assert got + rest == expected
        assert loader.metrics()["dispatch"]["restarts"] >= 1  # the worker was replaced
    with cp.Loader(pipe, config) as fresh:
        fresh.load_state_dict(sd)
        assert got + collect(fresh) == expected


class Raising(Flaky):
    """:class:`Flaky` that raises ``exc`` instead."""

    def __init__(self, n: int, at: int, exc: type[BaseException]) -> None:
        super().__init__(n, at)
        self.exc = exc

    def __getitem__(self, i: int) -> int:  # type: ignore[override]
        if i == self.at and not self.fired:
            self.fired = True
            raise self.exc
        return super().__getitem__(i)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_a_base_exception_from_a_central_stage_in_the_feeder(exc: type[BaseException]) -> None:
    """A central stage run by the feeder thread raises KeyboardInterrupt or
    SystemExit: the consumer gets it as raised (not wrapped, not a stage
    failure delivered late), the checkpoint taken then resumes exactly, and
    no thread is left."""
    expected = [2 * i for i in range(N)]
    config = loader_config(num_workers=2, buffer_size=32, chunk_size=8)
    with cp.Loader(_pipe("inline-stamped", Raising(N, 37, exc)), config) as loader:
        it = iter(loader)
        got: list[int] = []
        with pytest.raises(exc):
            while True:
                got.append(next(it))
        sd = loader.state_dict()
    with cp.Loader(_pipe("inline-stamped", range(N)), config) as fresh:
        fresh.load_state_dict(sd)
        assert got + collect(fresh) == expected


@pytest.mark.timeout(60)
def test_ctrl_c_as_worker_states_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Interrupted as worker_states() asks the workers: the flag that makes
    the supervisor read every worker (ignoring the byte bound) is not left
    set, and the pass goes on exactly."""
    real = ProcessPool.interrupt

    def interrupt(self: ProcessPool) -> None:
        if sys._getframe(1).f_code.co_name == "worker_states" and not fired:
            fired.append(1)
            raise KeyboardInterrupt
        real(self)

    fired: list[int] = []
    expected = [2 * i for i in range(N)]
    config = loader_config(num_workers=2, buffer_size=32, chunk_size=8)
    with cp.Loader(_pipe("inline-stamped", range(N)), config) as loader:
        it = iter(loader)
        got = [next(it) for _ in range(10)]
        monkeypatch.setattr(ProcessPool, "interrupt", interrupt)
        with pytest.raises(KeyboardInterrupt):
            loader.worker_states()
        monkeypatch.undo()
        run = loader._central._res.run
        assert fired and run is not None and run.session is not None
        assert run.session.asking is False
        assert got + list(it) == expected


# -- sweeps: an interrupt at every function entry of a call --------------------


def _interrupt_at(k: int, fn: Callable[[], Any]) -> bool:
    """Run ``fn`` with a KeyboardInterrupt at the entry of the ``k``-th
    function of centralpipe's code it runs (the soak's model of a Ctrl-C);
    True if it landed (and was raised), False if ``fn`` ran fewer."""
    count = 0
    fired = False

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count, fired
        if event != "call" or fired or faults._shielded(frame):
            return None
        count += 1
        if count >= k:
            fired = True
            sys.settrace(None)
            raise KeyboardInterrupt
        return None

    sys.settrace(trace)
    try:
        fn()
    except KeyboardInterrupt:
        assert fired, "a KeyboardInterrupt nobody injected"
        return True
    finally:
        sys.settrace(None)
    assert not fired, "the interrupt was swallowed"
    return False


def _sweep(attempt: Callable[[int], bool]) -> int:
    """Run ``attempt(k)`` for k = 1, 2, ... (it injects an interrupt at the
    k-th function entry and checks the outcome) until an interrupt no longer
    lands; return that k, the number of entries the swept call runs plus 1."""
    k = 1
    while attempt(k):
        k += 1
    return k


def _open_fds() -> set[str]:
    """Open fds, except multiprocessing's heap arenas (kept by the stdlib)."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not os.path.basename(target).startswith(f"pym-{os.getpid()}-"):
            out.add(f"{name} -> {target}")
    return out


def _live_children() -> list[int]:
    me = psutil.Process()
    out = []
    for child in me.children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
            if child.status() != psutil.STATUS_ZOMBIE and not any(
                name in cmdline for name in ("forkserver", "resource_tracker")
            ):
                out.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return out


def _settled(before: set[str]) -> set[str]:
    """New fds; collected first only if there are any (a closed loader's
    objects may be in a reference cycle: not a leak)."""
    new = _open_fds() - before
    if new:
        gc.collect()
        new = _open_fds() - before
    return new


SWEEP_N = 40


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [0, 1])
def test_ctrl_c_anywhere_in_the_first_next(workers: int) -> None:
    """An interrupt at every function entry of the first next() (the pass
    and the pool start): raised at once; the same iterator then delivers the
    whole epoch exactly, and close() leaves no fd and no process."""
    pipe = cp.Pipeline.from_iterable(range(SWEEP_N)).count("c").dispatch().map(_times2)
    expected = [2 * i for i in range(SWEEP_N)]
    config = loader_config(num_workers=workers, buffer_size=16, chunk_size=4)
    with cp.Loader(pipe, config) as warm:  # arenas and lazy imports, before counting
        collect(warm)
    before = _open_fds()

    def attempt(k: int) -> bool:
        loader: cp.Loader[int] = cp.Loader(pipe, config)
        it = iter(loader)
        got: list[int] = []
        landed = _interrupt_at(k, lambda: got.append(next(it)))
        got.extend(it)
        assert got == expected, f"interrupt at event {k}"
        loader.close()
        assert _live_children() == [], f"interrupt at event {k}"
        assert _settled(before) == set(), f"interrupt at event {k}"
        return landed

    assert _sweep(attempt) > 10


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["inline-stamped", "segment-stamped"])
def test_ctrl_c_anywhere_in_a_later_next(kind: str) -> None:
    """An interrupt at every function entry of a next() that pulls and runs
    (or sends) a new chunk: raised at once, nothing lost or repeated, and the
    checkpoint taken then resumes exactly."""
    expected = [2 * i for i in range(N)]
    config = _config(kind)
    pipe = _pipe(kind, range(N))

    def attempt(k: int) -> bool:
        with cp.Loader(pipe, config) as loader:
            it = iter(loader)
            got = [next(it) for _ in range(8)]  # the first chunk: the next next() pulls
            landed, sd, at = _interrupted_next_goes_on(k, loader, it, got, expected)
        with cp.Loader(pipe, config) as fresh:
            fresh.load_state_dict(sd)
            assert got[:at] + collect(fresh) == expected, f"interrupt at event {k}"
        return landed

    # How many events that next() runs depends on which results are in
    # already (a parallel stage's workers): at least one interrupt landed.
    assert _sweep(attempt) > 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork"])
def test_close_cut_short_anywhere_leaks_nothing(start_method: str) -> None:
    """close() interrupted at every function entry, then close() again: no
    fd (pipes, death pipes, rings, the wake-up pipe) and no worker left."""
    pipe = cp.Pipeline.from_iterable(range(SWEEP_N)).dispatch().map(_times2)
    config = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=2, buffer_size=16, start_method=start_method)
    )
    with cp.Loader(pipe, config) as warm:
        collect(warm)
    before = _open_fds()

    def attempt(k: int) -> bool:
        loader: cp.Loader[int] = cp.Loader(pipe, config)
        it = iter(loader)
        next(it)
        landed = _interrupt_at(k, loader.close)
        loader.close()
        assert loader.worker_pids() == []
        assert _live_children() == [], f"interrupt at event {k}"
        assert _settled(before) == set(), f"interrupt at event {k}"
        return landed

    assert _sweep(attempt) > 10


@pytest.mark.timeout(30)
def test_ring_close_cut_short_is_finished_by_the_next() -> None:
    """A shared-memory ring's close() cut short at any point is finished by
    the next call: no descriptor stays open."""
    if not ringreader.available():
        pytest.skip("no memfd_create here")

    def attempt(k: int) -> bool:
        before = _open_fds()
        ring = ringreader.Ring(1 << 16)
        landed = _interrupt_at(k, ring.close)
        ring.close()
        assert ring.fds() == [] and _open_fds() - before == set(), f"interrupt at event {k}"
        return landed

    _sweep(attempt)


@pytest.mark.timeout(60)
def test_a_failed_start_whose_close_is_cut_short_is_closed_by_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pool's start fails and the close after it is cut short too: the
    pool stays registered, so the loader's close() ends its workers and
    closes every fd."""
    pipe = cp.Pipeline.from_iterable(range(SWEEP_N)).dispatch().map(_times2)
    config = loader_config(num_workers=2)
    with cp.Loader(pipe, config) as warm:
        collect(warm)
    before = _open_fds()
    real_start, real_close = ProcessPool.start, ProcessPool.close
    monkeypatch.setattr(ProcessPool, "start", _once_at(real_start, 1, after=True))
    monkeypatch.setattr(ProcessPool, "close", _once_at(real_close, 1))
    loader: cp.Loader[int] = cp.Loader(pipe, config)
    with pytest.raises(KeyboardInterrupt):
        next(iter(loader))
    monkeypatch.undo()
    loader.close()
    assert _live_children() == []
    assert _settled(before) == set()


def test_no_thread_left() -> None:
    """(The module's loaders leave no centralpipe thread.)"""
    assert [t.name for t in threading.enumerate() if t.name.startswith("centralpipe-")] == []
