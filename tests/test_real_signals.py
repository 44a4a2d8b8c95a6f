"""Real SIGINTs from a timer thread while the main thread loops over
``next()``, ``state_dict()``, ``query()``, ``load_state_dict()`` and
``close()``, catching ``KeyboardInterrupt`` and going on.

Unlike the patched raises and the trace-hook sweeps of
``tests/test_dispatch_interrupts.py``, a real signal is handled wherever
CPython checks for one: as a Python function starts (a Python ``__exit__``
before it releases its lock) and right after a call into C returns (an
acquire that took a lock, a ``next()`` that advanced an iterator). Each
round sends one SIGINT at a seeded random delay; the delivered items must
equal the uninterrupted run (nothing lost, nothing twice), checkpoints taken
amid the interrupts resume exactly, and no wait outlasts its bound (the
chain-lock bound is lowered so a lock left held fails fast, not hangs).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.dispatch import guard
from centralpipe.testing import collect
from tests._configs import loader_config

N = 200
ROUNDS = 150
#: Each round's SIGINT comes within this many seconds.
MAX_DELAY_S = 0.002
#: How long a round waits for a sent SIGINT to surface before calling it
#: swallowed (some other handler's ``Exception ignored``).
SURFACE_S = 0.05


def _times2(x: int) -> int:
    return 2 * x


def _same(batch: list[int]) -> list[int]:
    return batch


def _one(x: int) -> int:
    return 1


#: "stages": central stages that pull item by item in the caller's thread
#: (map, count, batch, flat_map), each taking inputs through ``pull_one``;
#: "regroup": a bucket and a batch, which pull inputs in bulk (``pull_into``).
KINDS = {
    "inline": (0, lambda p: p.dispatch().map(_times2)),
    "stages": (
        0,
        lambda p: p.map(_times2).count(name="counted").batch(4).flat_map(_same).dispatch(),
    ),
    "workers": (2, lambda p: p.dispatch().map(_times2)),
    "parallel": (2, lambda p: p.map(_times2, parallel=True).dispatch()),
    # bulk pulls: a bucket of unit lengths keeps arrival order, a batch its group
    "regroup": (
        0,
        lambda p: (
            p.map(_times2)
            .bucket_by_max_tokens(4, len_fn=_one, buffer_size=16)
            .flat_map(_same)
            .batch(3)
            .flat_map(_same)
            .dispatch()
        ),
    ),
}
SOURCE = "source"


def _pipe(kind: str) -> cp.Pipeline:
    return KINDS[kind][1](cp.Pipeline.from_iterable(range(N)))


def _config(kind: str) -> cp.LoaderConfig:
    return loader_config(num_workers=KINDS[kind][0], buffer_size=32, chunk_size=8)


EXPECTED = [2 * i for i in range(N)]


class Signals:
    """Rounds of one real SIGINT each (``os.kill`` from a timer thread, as
    Ctrl-C sends it), at a seeded random delay, while ``step()`` runs over
    and over; the interrupt is caught wherever it lands and the next round
    goes on."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.landed = 0
        self.swallowed = 0

    def rounds(self, n: int, step: Callable[[], None]) -> None:
        pid = os.getpid()
        for _ in range(n):
            timer = threading.Timer(self.rng.uniform(0, MAX_DELAY_S), os.kill, (pid, signal.SIGINT))
            try:
                try:
                    timer.start()
                    while not timer.finished.is_set():
                        step()
                    _wait(SURFACE_S)
                    self.swallowed += 1
                except KeyboardInterrupt:
                    self.landed += 1
            except BaseException:
                # A failed check: no SIGINT may reach the test runner.
                timer.cancel()
                try:
                    _wait(SURFACE_S)
                except KeyboardInterrupt:
                    pass
                raise
            timer.join(10)
            assert not timer.is_alive()


def _wait(seconds: float) -> None:
    """Sleep ``seconds`` in short steps (a SIGINT sent surfaces in it)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.0005)


class Consumer:
    """The main thread's side: epochs read with ``for`` (a Ctrl-C landing
    between ``next()`` and the loop's body loses nothing there), each
    compared with the uninterrupted run."""

    def __init__(self, loader: cp.Loader[Any], rng: random.Random) -> None:
        self.loader = loader
        self.rng = rng
        self.it: Any = None
        self.got: list[int] = []
        self.epochs = 0
        self.saved: tuple[dict[str, Any], int] | None = None
        #: Interrupts that landed in load_state_dict() (caught there, retried).
        self.caught = 0

    def read(self) -> None:
        """A few items, or the end of the epoch (then it is checked)."""
        if self.it is None:
            self.it = iter(self.loader)
        for x in self.it:
            self.got.append(x)
            if self.rng.random() < 0.2:
                return
        got, self.got, self.it = self.got, [], None
        self.saved = None  # of the epoch just ended
        assert got == EXPECTED, f"epoch {self.epochs}: {_diff(got)}"
        self.epochs += 1

    def save(self) -> None:
        self.saved = (self.loader.state_dict(), len(self.got))

    def load(self) -> None:
        """Load the saved checkpoint (again, until a call is not cut short:
        loading one checkpoint twice is loading it once) and resume it."""
        if self.saved is None:
            return
        sd, at = self.saved
        self.saved = None
        while True:
            try:
                self.loader.load_state_dict(sd)
                break
            except KeyboardInterrupt:
                self.caught += 1
        # From here on plain statements: the next read() resumes the checkpoint.
        self.got = self.got[:at]
        self.it = None


def _diff(got: list[int]) -> str:
    for i, (a, b) in enumerate(zip(got, EXPECTED)):
        if a != b:
            return f"first difference at {i}: got {got[i : i + 4]}, expected {EXPECTED[i : i + 4]}"
    return f"{len(got)} items, expected {len(EXPECTED)}"


@pytest.fixture(autouse=True)
def _short_chain_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    # A chain lock left held shows up as a TimeoutError within seconds.
    monkeypatch.setattr(guard, "CENTRAL_WAIT_S", 5.0)


def _mixed(c: Consumer, op: str) -> Callable[[], None]:
    def step() -> None:
        r = c.rng.random()
        if r < 0.5 or op == "next":
            c.read()
        elif op == "state_dict":
            c.loader.state_dict()
        elif op == "query":
            c.loader.query(SOURCE)
        elif op == "load_state_dict":
            if c.saved is None:
                c.save()
            else:
                c.load()

    return step


OPS = ["next", "state_dict", "query", "load_state_dict"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_real_sigint_leaves_no_lock_held_and_loses_nothing(kind: str, op: str) -> None:
    """A real SIGINT at random points of next() and of state_dict(),
    query() or load_state_dict() between reads: every epoch delivers exactly
    the uninterrupted run's items, no call waits out the chain lock's bound,
    and a checkpoint taken amid the interrupts resumes exactly."""
    seed = sorted(KINDS).index(kind) * 10 + OPS.index(op)
    signals = Signals(seed)
    with cp.Loader(_pipe(kind), _config(kind)) as loader:
        c = Consumer(loader, random.Random(seed))
        signals.rounds(ROUNDS, _mixed(c, op))
        assert signals.landed + c.caught > ROUNDS // 2
        c.saved = None
        sd, at = loader.state_dict(), len(c.got)
        assert c.got + list(c.it if c.it is not None else iter(loader)) == EXPECTED
    with cp.Loader(_pipe(kind), _config(kind)) as fresh:
        fresh.load_state_dict(sd)
        assert c.got[:at] + collect(fresh) == EXPECTED


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", list(KINDS))
def test_real_sigint_in_close_ends_everything(kind: str) -> None:
    """Loaders started, read and closed under real SIGINTs, each close()
    called again until a call is not cut short: every one read exactly the
    first items, and none leaves a worker or a centralpipe thread."""
    signals = Signals(7)
    loaders: list[cp.Loader[Any]] = []
    reads: list[list[int]] = []

    def step() -> None:
        if loaders and not loaders[-1]._closed:
            loaders[-1].close()
            return
        loader = cp.Loader(_pipe(kind), _config(kind))
        loaders.append(loader)
        got: list[int] = []
        reads.append(got)
        for x in loader:
            got.append(x)
            if len(got) == 10:
                break

    signals.rounds(40, step)
    for loader in loaders:
        while True:
            try:
                loader.close()
                break
            except KeyboardInterrupt:  # pragma: no cover - no timer is running now
                continue
        assert loader.worker_pids() == []
    assert [t.name for t in threading.enumerate() if t.name.startswith("centralpipe-")] == []
    assert signals.landed > 20
    assert all(got == EXPECTED[: len(got)] for got in reads)


def test_no_thread_left() -> None:
    """(The module's loaders leave no centralpipe thread.)"""
    assert [t.name for t in threading.enumerate() if t.name.startswith("centralpipe-")] == []
