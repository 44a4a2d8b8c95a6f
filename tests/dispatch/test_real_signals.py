"""Real SIGINTs from a timer thread while the main thread loops over
``next()``, ``state_dict()``, ``query()``, ``load_state_dict()`` and
``close()``, catching ``KeyboardInterrupt`` and going on.

Unlike the patched raises and the trace-hook sweeps of
``tests/dispatch/test_dispatch_interrupts.py``, a real signal is handled wherever
CPython checks for one: as a Python function starts (a Python ``__exit__``
before it releases its lock) and right after a call into C returns (an
acquire that took a lock, a ``next()`` that advanced an iterator). Each
round sends one SIGINT at a seeded random delay; the delivered items must
equal the uninterrupted run (nothing lost, nothing twice), checkpoints taken
amid the interrupts resume exactly, and no wait outlasts its bound (the
chain-lock bound is lowered so a lock left held fails fast, not hangs).
"""

from __future__ import annotations

import _thread
import atexit
import itertools
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import centralpipe as cp
from centralpipe import config
from centralpipe.testing import collect
from tests.support.configs import loader_config

N = 200
ROUNDS = 150
#: Rounds of the shuffle/bucket/pack tests (each round runs many epochs' worth
#: of calls of those stages: fewer rounds keep the module short).
STAGE_ROUNDS = 80
#: Each round's SIGINT comes within this many seconds.
MAX_DELAY_S = 0.002
#: How long a round waits for a sent SIGINT to surface before calling it
#: swallowed (some other handler's ``Exception ignored``).
SURFACE_S = 0.05


def _times2(x: int) -> int:
    return 2 * x


def _line_times2(line: str) -> int:
    return 2 * int(line)


def _same(batch: list[int]) -> list[int]:
    return batch


def _size(x: int) -> int:
    return x % 5 + 1


def _one(x: int) -> int:
    return 1


def _tokens(x: int) -> np.ndarray:
    return np.full(x % 5 + 1, x, dtype=np.int32)


def _firsts(batch: list[np.ndarray]) -> list[int]:
    return [int(a[0]) for a in batch]


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
    # Lines of files sent as byte ranges the workers read (read_in_workers),
    # cut in the caller's thread (no stage after dispatch: no feeder).
    "ranges": (2, lambda p: p.read_lines().map(_line_times2, parallel=True)),
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
#: Central stages that move an item between their buffer and the output in
#: the caller's thread (no workers): shuffle's draw, the bucket's move from
#: heap to batch and its emit, pack's placement and emit. Their outputs
#: (lists) are flattened by a central flat_map.
STAGE_KINDS = {
    "shuffle": lambda p: p.shuffle(16).dispatch(),
    "bucket": lambda p: (
        p.bucket_by_max_tokens(12, len_fn=_size, buffer_size=16).flat_map(_same).dispatch()
    ),
    # array items: the bucket's heap kept as sealed segments once a state was
    # taken (checkpoint.table), the arena's bookkeeping next to each heap call
    "bucket-arrays": lambda p: (
        p.map(_tokens).bucket_by_max_tokens(12, buffer_size=16).flat_map(_firsts).dispatch()
    ),
    "pack-best-fit": lambda p: p.pack(12, len_fn=_size, buffer_size=16).flat_map(_same).dispatch(),
    # read_lines pulled line by line (produce): the file read and the position moved
    "read-lines": lambda p: p.read_lines().map(int).dispatch(),
    "pack-first-fit": lambda p: (
        p.pack(12, len_fn=_size, buffer_size=16, strategy="first_fit").flat_map(_same).dispatch()
    ),
}
SOURCE = "source"
#: The files "ranges" reads: the lines "0" ... "N-1", in three files.
_LINES_DIR: list[str] = []


def _lines_glob() -> str:
    if not _LINES_DIR:
        root = tempfile.mkdtemp(prefix="centralpipe-signals-")
        atexit.register(shutil.rmtree, root, True)
        for i, part in enumerate((range(0, 70), range(70, 71), range(71, N))):
            with open(os.path.join(root, f"{i}.txt"), "w") as f:
                f.writelines(f"{x}\n" for x in part)
        _LINES_DIR.append(root)
    return os.path.join(_LINES_DIR[0], "*.txt")


def _pipe(kind: str) -> cp.Pipeline:
    if kind in ("ranges", "read-lines"):
        build = KINDS[kind][1] if kind in KINDS else STAGE_KINDS[kind]
        return build(cp.Pipeline.from_files(_lines_glob(), name=SOURCE))
    build = KINDS[kind][1] if kind in KINDS else STAGE_KINDS[kind]
    return build(cp.Pipeline.from_iterable(range(N)))


def _config(kind: str) -> cp.LoaderConfig:
    workers = KINDS[kind][0] if kind in KINDS else 0
    return loader_config(num_workers=workers, buffer_size=32, chunk_size=8)


EXPECTED = [2 * i for i in range(N)]


class Reference:
    """The uninterrupted run's items of each epoch (a shuffle's order changes
    from epoch to epoch), read before the signals start (a read cut short by
    one would count for nothing)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.epochs = self._read(2)
        #: The same items every epoch (no shuffle).
        self.same = self.epochs[0] == self.epochs[1]

    def _read(self, n: int) -> list[list[Any]]:
        with cp.Loader(_pipe(self.kind), _config(self.kind)) as loader:
            return [collect(loader) for _ in range(n)]

    def __call__(self, epoch: int) -> list[Any]:
        if self.same:
            return self.epochs[0]
        if epoch >= len(self.epochs):
            # Read again from the start and put in place at once: a read cut
            # short by a signal changes nothing, and the next call reads again.
            self.epochs = self._read(max(2 * len(self.epochs), epoch + 1))
        return self.epochs[epoch]


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
            # A bare thread, not a threading.Timer: starting a Timer waits on a
            # Python-level Condition, where a SIGINT sent at once (a delay near
            # 0, or a slow start under load) breaks the harness itself
            # ("release unlocked lock") instead of landing in the code tested.
            fired: list[bool] = []
            cancelled: list[bool] = []
            delay = self.rng.uniform(0, MAX_DELAY_S)
            try:
                try:
                    # A C call: a SIGINT is handled as it returns, the thread started.
                    _thread.start_new_thread(_kill_later, (delay, pid, fired, cancelled))
                    while not fired:
                        step()
                    _wait(SURFACE_S)
                    self.swallowed += 1
                except KeyboardInterrupt:
                    self.landed += 1
            except BaseException:
                # A failed check: no SIGINT may reach the test runner.
                cancelled.append(True)
                try:
                    _wait(SURFACE_S + MAX_DELAY_S)
                except KeyboardInterrupt:
                    pass
                raise
            deadline = time.monotonic() + 10
            while not fired and time.monotonic() < deadline:
                time.sleep(0.001)
            assert fired


def _kill_later(delay: float, pid: int, fired: list[bool], cancelled: list[bool]) -> None:
    """The timer thread of one round: SIGINT to ``pid`` after ``delay`` s
    unless the round was cancelled, then ``fired`` (set even if cancelled)."""
    time.sleep(delay)
    if not cancelled:
        os.kill(pid, signal.SIGINT)
    fired.append(True)


def _wait(seconds: float) -> None:
    """Sleep ``seconds`` in short steps (a SIGINT sent surfaces in it)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.0005)


class Consumer:
    """The main thread's side: epochs read with ``for`` (a Ctrl-C landing
    between ``next()`` and the loop's body loses nothing there), each
    compared with the uninterrupted run."""

    def __init__(
        self,
        loader: cp.Loader[Any],
        rng: random.Random,
        expected: Callable[[int], list[Any]] = lambda epoch: EXPECTED,
    ) -> None:
        self.loader = loader
        self.rng = rng
        #: The uninterrupted run's items of epoch ``i`` (0: the first).
        self.expected = expected
        self.it: Any = None
        self.got: list[int] = []
        self.epochs = 0
        self.saved: tuple[dict[str, Any], int] | None = None
        #: The epoch's last item was read and the epoch not yet checked.
        self.ended = False
        #: Interrupts that landed in load_state_dict() (caught there, retried).
        self.caught = 0

    def read(self) -> None:
        """A few items, or the end of the epoch (then it is checked)."""
        if not self.ended:
            if self.it is None:
                self.it = iter(self.loader)
            for x in self.it:
                self.got.append(x)
                if self.rng.random() < 0.2:
                    return
            self.ended = True
        # Checked before anything changes: an interrupt in the check (the
        # reference may be read now) leaves the ended epoch to check again.
        want = self.expected(self.epochs)
        assert self.got == want, f"epoch {self.epochs}: {_diff(self.got, want)}"
        self.got, self.it, self.saved, self.ended = [], None, None, False
        self.epochs += 1

    def save(self) -> None:
        if not self.ended:  # (an ended epoch is checked, and its saved state dropped, first)
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
        self.ended = False


def _diff(got: list[Any], expected: list[Any]) -> str:
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            return f"first difference at {i}: got {got[i : i + 4]}, expected {expected[i : i + 4]}"
    return f"{len(got)} items, expected {len(expected)}"


@pytest.fixture(autouse=True)
def _short_chain_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    # A chain lock left held shows up as a TimeoutError within seconds.
    monkeypatch.setattr(config, "CENTRAL_WAIT_S", 5.0)


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
@pytest.mark.parametrize("op", ["next", "load_state_dict"])
@pytest.mark.parametrize("kind", list(STAGE_KINDS))
def test_real_sigint_in_shuffle_bucket_and_pack_loses_nothing(kind: str, op: str) -> None:
    """A real SIGINT anywhere in next() (and in load_state_dict() between
    reads) of shuffle, bucket_by_max_tokens and pack run in the caller's
    thread: every epoch is the uninterrupted run's, item for item, and
    checkpoints taken amid the interrupts resume exactly (no item lost or
    twice, no stage state left half-changed)."""
    reference = Reference(kind)
    assert sorted(reference(0)) == list(range(N))
    seed = 100 + sorted(STAGE_KINDS).index(kind) * 10 + OPS.index(op)
    signals = Signals(seed)
    with cp.Loader(_pipe(kind), _config(kind)) as loader:
        c = Consumer(loader, random.Random(seed), reference)
        signals.rounds(STAGE_ROUNDS, _mixed(c, op))
        assert signals.landed + c.caught > STAGE_ROUNDS // 2
        assert c.epochs > 1
        c.saved = None
        sd, head, epoch = loader.state_dict(), list(c.got), c.epochs
        while c.epochs == epoch:  # the rest of this epoch, checked (no timer runs now)
            c.read()
    with cp.Loader(_pipe(kind), _config(kind)) as fresh:
        fresh.load_state_dict(sd)
        rest = collect(fresh)
    if sd["finished"]:  # taken after an epoch's last item: it resumes the next
        after = epoch + 1 if head else epoch  # head: that epoch, not yet checked then
        assert (head, rest) == (reference(epoch) if head else [], reference(after))
    else:
        assert head + rest == reference(epoch)


class _Cut(KeyboardInterrupt):
    """The interrupt :func:`_cut_at` raises."""


STAGES_DIR = os.path.join(os.path.dirname(cp.__file__), "stages") + os.sep


def _cut_at(kind: str, at: int, k: int) -> tuple[list[Any], str | None, list[Any]]:
    """An epoch read with ``next()``, whose call after ``at`` items raises
    ``KeyboardInterrupt`` at the ``k``-th event of the stages' code (a
    function's start, or a C call's return: where CPython handles a SIGINT),
    then goes on with the same iterator; the items, where it landed
    (``None``: that call had fewer events), and the items delivered before
    the cut followed by a fresh loader's from a state taken just after it.
    A state is taken before the cut too (stages may keep their saved form
    as they go once one was asked for)."""
    count, where = 0, None

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count, where
        if event not in ("call", "c_return") or not frame.f_code.co_filename.startswith(STAGES_DIR):
            return
        count += 1
        if count == k:
            sys.setprofile(None)
            where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {event}"
            raise _Cut(where)

    with cp.Loader(_pipe(kind), _config(kind)) as loader:
        it = iter(loader)
        got = [next(it) for _ in range(at)]
        loader.state_dict()
        sys.setprofile(profile)
        try:
            got.append(next(it))
        except _Cut:
            pass
        finally:
            sys.setprofile(None)
        head, state = list(got), loader.state_dict()
        got.extend(it)
    with cp.Loader(_pipe(kind), _config(kind)) as fresh:
        fresh.load_state_dict(state)
        resumed = head + list(fresh)
    return got, where, resumed


# (a fresh loader resumes after every cut: about 30 s for bucket-arrays on
# an idle 2-CPU machine, four times that when it is shared)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", list(STAGE_KINDS))
def test_an_interrupt_as_any_call_of_the_stage_returns_loses_nothing(kind: str) -> None:
    """A KeyboardInterrupt at every function start and C call return of the
    stages' code in one next() (at three points of the epoch; what a real
    SIGINT hits only by chance): the same iterator then gives exactly the
    uninterrupted run's items, and so does a resume from a state taken just
    after the cut."""
    expected = Reference(kind)(0)
    cuts = 0
    # A next() runs the stages when it starts a chunk (every chunk_size=8
    # items: see _config); within a chunk it runs none, and cuts nothing.
    for at in (0, 56, 128):
        for k in itertools.count(1):
            got, where, resumed = _cut_at(kind, at, k)
            if where is None:
                break
            cuts += 1
            assert got == expected, f"cut after {at} items at {where}: {_diff(got, expected)}"
            assert resumed == expected, (
                f"resumed after a cut at {where}: {_diff(resumed, expected)}"
            )
    assert cuts > 30


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
