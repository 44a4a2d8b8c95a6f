"""Bounded waits on the central chain: a central ``next()`` that blocks (a
source stuck on a read, a parallel stage waiting for a hung worker) never
makes ``close()``, ``metrics()`` or delivery of items already pulled wait;
``state_dict()``, ``query()``, ``load_state_dict()`` and the start of a pass
wait at most ``CENTRAL_WAIT_S``, then raise ``TimeoutError`` naming the stage,
and change nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import centralpipe as cp
from centralpipe import config
from centralpipe.dispatch import chainlock, timeouts
from centralpipe.testing import collect
from tests.support.configs import loader_config

N = 200
BLOCK_AT = 50
#: The longest any test waits for a blocked call to be released.
RELEASE_S = 60.0
#: The item a parallel stage hangs on, and the outputs taken before it is needed.
HUNG, TAKEN = 4, 1


def _times2(x: int) -> int:
    return 2 * x


class BlockingSource:
    """A re-iterable whose iterator blocks before item ``at`` until released
    (once per source), and counts the items it yields."""

    def __init__(self, n: int = N, at: int = BLOCK_AT) -> None:
        self.n, self.at = n, at
        self.release = threading.Event()
        self.blocked = threading.Event()
        self.yielded = 0

    def __call__(self) -> Iterator[int]:
        for i in range(self.n):
            if i == self.at and not self.release.is_set():
                self.blocked.set()
                self.release.wait(RELEASE_S)
            self.yielded += 1
            yield i


def _pipe(src: BlockingSource) -> cp.Pipeline:
    return cp.Pipeline.from_iterable(src, name="src").count("c").dispatch().map(_times2)


def _config() -> cp.LoaderConfig:
    return loader_config(num_workers=2, chunk_size=1, buffer_size=None)


def _bounded(fn: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    """Run ``fn`` in a thread; fail (instead of hanging) if it does not return."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{fn} did not return within {timeout_s} s"
    if errors:
        raise errors[0]
    return out[0]


@pytest.fixture
def short_wait(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """A 0.3 s bound for the test; the returned function restores a long one
    (for the calls after the blocked stage is released, on a busy machine)."""
    monkeypatch.setattr(config, "CENTRAL_WAIT_S", 0.3)
    return lambda: monkeypatch.setattr(config, "CENTRAL_WAIT_S", 30.0)


@pytest.mark.timeout(60)
def test_close_does_not_wait_for_a_blocked_source() -> None:
    """close() returns while a central source is stuck in next(); the stuck
    thread pulls nothing more once that call returns."""
    src = BlockingSource()
    loader = cp.Loader(_pipe(src), _config())
    try:
        it = iter(loader)
        assert [next(it) for _ in range(10)] == [2 * i for i in range(10)]
        assert src.blocked.wait(RELEASE_S)
        _bounded(loader.close)
        assert loader.worker_pids() == []
    finally:
        src.release.set()
    # the blocked call returns item BLOCK_AT; the closed run takes no other
    threading.Event().wait(0.2)
    assert src.yielded == BLOCK_AT + 1


@pytest.mark.timeout(60)
def test_a_stop_does_not_wait_for_a_feeder_inside_a_central_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopping a pass whose feeder is inside a blocked central next() does
    not wait for it (the feeder says where it is: ``in_central``), however
    long the bound for a feeder stuck in a send is."""
    monkeypatch.setattr(timeouts, "STOP_TIMEOUT_S", 600.0)
    src = BlockingSource()
    loader = cp.Loader(_pipe(src), _config())
    try:
        it = iter(loader)
        assert next(it) == 0
        assert src.blocked.wait(RELEASE_S)
        feeder = loader._central._res.run.feeder
        assert feeder is not None
        assert _bounded(lambda: _wait_for(feeder.in_central))
        _bounded(loader.close)
    finally:
        src.release.set()


def _wait_for(ready: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Whether ``ready()`` holds within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.timeout(60)
def test_items_pulled_before_a_blocked_next_are_delivered_and_metrics_answer() -> None:
    """While the source blocks, the consumer still receives every item pulled
    before it, and metrics(), query(delivered=True) and a count's live query
    (its last published totals) answer at once."""
    src = BlockingSource()
    with cp.Loader(_pipe(src), _config()) as loader:
        it = iter(loader)
        first = next(it)
        assert src.blocked.wait(RELEASE_S)
        got = [first, *_bounded(lambda: [next(it) for _ in range(BLOCK_AT - 1)])]
        assert got == [2 * i for i in range(BLOCK_AT)]
        metrics = _bounded(loader.metrics)
        assert metrics["dispatch"]["delivered"] == BLOCK_AT
        assert _bounded(lambda: loader.query("c", delivered=True))["items"] == BLOCK_AT
        assert _bounded(lambda: loader.query("c")) == {"items": BLOCK_AT, "weight": BLOCK_AT}
        src.release.set()
        assert got + list(it) == [2 * i for i in range(N)]


@pytest.mark.timeout(60)
def test_readers_time_out_naming_the_blocked_stage(short_wait: Callable[[], None]) -> None:
    """state_dict(), query() of a stage without a live view and
    load_state_dict() give up after CENTRAL_WAIT_S with a TimeoutError naming
    the stage; nothing changed, and once the stage returns the checkpoint
    resumes exactly."""
    src = BlockingSource()
    expected = [2 * i for i in range(N)]
    with cp.Loader(_pipe(src), _config()) as loader:
        good = loader.state_dict()
        it = iter(loader)
        got = [next(it) for _ in range(10)]
        assert src.blocked.wait(RELEASE_S)
        for call in (loader.state_dict, lambda: loader.query("src")):
            with pytest.raises(TimeoutError, match=r"central stage 'src' has not returned"):
                _bounded(call)
        with pytest.raises(TimeoutError, match="load_state_dict"):
            _bounded(lambda: loader.load_state_dict(good))
        # nothing changed: the iterator goes on, and the position is exact
        got += [next(it) for _ in range(5)]
        short_wait()
        src.release.set()
        sd = loader.state_dict()
        assert got + list(it) == expected
    with cp.Loader(_pipe(BlockingSource(at=N)), _config()) as fresh:
        fresh.load_state_dict(sd)
        assert got + collect(fresh) == expected


@pytest.mark.timeout(60)
def test_a_new_pass_does_not_run_beside_a_blocked_next(short_wait: Callable[[], None]) -> None:
    """A pass superseded while its feeder is stuck in next(): the next pass
    refuses to start (TimeoutError naming the stage, epoch unchanged) until
    that call returns, then delivers its whole epoch."""
    src = BlockingSource(at=BLOCK_AT)
    with cp.Loader(_pipe(src), _config()) as loader:
        it = iter(loader)
        next(it)
        assert src.blocked.wait(RELEASE_S)
        it = iter(loader)  # supersedes the stuck pass, at once
        with pytest.raises(TimeoutError, match=r"starting a pass .*'src'"):
            _bounded(lambda: next(it))
        assert loader.epoch == 1
        short_wait()
        src.release.set()
        assert collect(loader) == [2 * i for i in range(N)]
        assert loader.epoch == 2


def _wait_until_inside(loader: cp.Loader[Any], stage: str) -> None:
    """Wait until the thread running the central chain is inside ``stage``."""
    for _ in range(int(RELEASE_S / 0.01)):
        found = chainlock.busy_stage(loader._central._res.nodes)
        if found is not None and found[0].name == stage:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"the central chain never entered stage {stage!r}")


def _wait_for_count(loader: cp.Loader[Any], stage: str, n: int) -> None:
    """Wait until the count ``stage`` has seen ``n`` items (its query is live)."""
    for _ in range(int(RELEASE_S / 0.01)):
        if loader.query(stage)["items"] >= n:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"the count {stage!r} never saw {n} items")


class Gate:
    """A function for a parallel stage that blocks on item ``at`` until released."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.release = threading.Event()
        self.blocked = threading.Event()

    def __call__(self, x: int) -> int:
        if x == self.at and not self.release.is_set():
            self.blocked.set()
            self.release.wait(RELEASE_S)
        return x + 1


@pytest.mark.timeout(60)
def test_readers_waiting_for_a_parallel_stage_time_out_naming_it(
    short_wait: Callable[[], None],
) -> None:
    """A parallel stage waiting for a hung worker: state_dict() and query()
    of a stage without a live view raise TimeoutError naming it after the
    bound (a count's live query answers at once); close() does not wait.

    Item ``HUNG`` hangs. Chunks go round-robin within each stream (its
    first chunk to worker ``stream id % workers``): the tok stage (stream 0)
    sends its first 8 items at once, ``HUNG`` (even) to worker 0, and the
    boundary's first chunk (stream 1) goes to worker 1, so ``TAKEN`` output
    comes; the next one assigned to worker 0 waits behind the hung item."""
    gate = Gate(at=HUNG)
    pipe = (
        cp.Pipeline.from_iterable(range(N))
        .map(gate, parallel=True, name="tok")
        .count("c")
        .dispatch()
        .map(_times2)
    )
    config = loader_config(num_workers=2, chunk_size=1, buffer_size=8, executor="thread")
    expected = [2 * (i + 1) for i in range(N)]
    loader = cp.Loader(pipe, config)
    try:
        it = iter(loader)
        got = [next(it) for _ in range(TAKEN)]
        _wait_for_count(loader, "c", HUNG)
        _wait_until_inside(loader, "tok")  # so the feeder needs item HUNG
        with pytest.raises(TimeoutError, match="parallel stage 'tok' is still waiting"):
            _bounded(loader.state_dict)
        with pytest.raises(TimeoutError, match="'tok'"):
            _bounded(lambda: loader.query("tok"))
        assert _bounded(lambda: loader.query("c"))["items"] == HUNG
        short_wait()
        gate.release.set()
        sd = loader.state_dict()
        assert got + list(it) == expected
        gate.release.clear()
        gate.blocked.clear()
        it = iter(loader)
        assert [next(it) for _ in range(TAKEN)] == expected[:TAKEN]
        _wait_for_count(loader, "c", HUNG)
        _wait_until_inside(loader, "tok")
        _bounded(loader.close)
    finally:
        gate.release.set()
        loader.close()
    with cp.Loader(pipe, config) as fresh:
        fresh.load_state_dict(sd)
        assert got + collect(fresh) == expected
