"""The executors: where worker stages run — processes or threads.

An :class:`Executor` owns ``num_workers`` *slots*; each slot has one worker
(a process with a duplex pipe, or a thread with an inbox queue), a send lock
and a shared status array (see :mod:`centralpipe.dispatch.wire.protocol`). The
supervisor talks to both kinds through the same few calls: ``send`` (blocking,
by the sending thread only), ``wait`` (by the supervisor thread only),
``replace``, ``kill`` and ``close``. This module holds what both share; the
two kinds live in :mod:`centralpipe.dispatch.executors.procpool` (processes) and
:mod:`centralpipe.dispatch.executors.threadpool` (threads).
"""

import abc
import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from centralpipe.dispatch.wire import ringreader
from centralpipe.dispatch.wire.protocol import (
    STATUS_READY,
    Encoded,
    read_status,
)
from centralpipe.dispatch.worker.loop import WorkerSpec

__all__ = ["ABANDON_ALL", "Event", "Executor", "Slot", "describe_exit"]

#: ``current_run`` value that makes every worker skip whatever is queued.
ABANDON_ALL = 2**62


def describe_exit(exitcode: int | None) -> str:
    """``"exit code 3"`` / ``"killed by SIGKILL"`` / ``"still running"``."""
    import signal

    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class Slot:
    """One worker position: its current worker, channel, and status."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: Any = None  # a Process, or a Thread
        self.conn: Connection | None = None  # processes
        self.inbox: queue.Queue[Encoded | None] | None = None  # threads
        self.status: Any = None
        self.gen = 0  # bumped at each replacement; chunks remember where they went
        self.send_lock = threading.Lock()
        # Write end of the worker's death pipe (see dispatch.worker): held
        # here alone, closed when the worker is replaced or the pool closes.
        self.death: Connection | None = None
        #: A send to this worker is in progress: its results are read even
        #: while paused (dispatch.budget), so the send cannot block forever.
        self.sending = False
        # The worker's shared-memory ring for results (dispatch.shm), one per
        # worker generation; None without one.
        self.ring: ringreader.Ring | None = None
        #: A send to this worker was cut short (Ctrl-C) and it was killed
        #: for it: its replacement is no fault of the item it was on.
        self.cut_short = False

    def ready(self) -> bool:
        """The worker got as far as its receive loop."""
        return self.status is not None and bool(self.status[STATUS_READY])

    def busy(self) -> tuple[int, int, int, float] | None:
        """``(stream, seq, stage index, started)`` of the item in progress."""
        return None if self.status is None else read_status(self.status)


class Event(NamedTuple):
    """A message from a slot's worker, or (``message is None``) its death;
    ``nbytes``: what the message holds in this process (``dispatch.budget``)."""

    slot: Slot
    message: Any
    nbytes: int = 0


class Executor(abc.ABC):
    """``num_workers`` workers running :func:`~centralpipe.dispatch.worker.loop.serve`."""

    kind = ""
    #: Whether a hung worker can be killed and replaced.
    can_kill = True

    def __init__(self, num_workers: int, spec: WorkerSpec) -> None:
        self.spec = spec
        self.slots = [Slot(i) for i in range(num_workers)]
        self.closed = False
        self.shut = False
        #: Measure the bytes of results (set by the run when it bounds them).
        self.measure = False
        #: The one reader of the workers' messages (a run's supervisor, see
        #: :meth:`claim`); taken with ``read_lock`` before each read.
        self.reader: object | None = None
        self.read_lock = threading.Lock()

    def claim(self, reader: object) -> None:
        """Make ``reader`` the only one whose :meth:`wait` reads messages.

        An earlier reader (the supervisor of a run whose stop gave up
        waiting for it) may still be inside a ``wait`` or about to call it:
        from now on it reads nothing, so a result of the new run can never
        be taken, and dropped, by the thread of an old one."""
        with self.read_lock:
            self.reader = reader

    def start(self, stop: Callable[[], bool] | None = None) -> None:
        """Start every worker; ``stop``: checked before each, ends the start
        early (a background start cancelled, see dispatch.starter)."""
        for slot in self.slots:
            if stop is not None and stop():
                return
            self._start(slot)

    def lendable_bytes(self) -> int | None:
        """Bytes of results the workers' rings can lend at once (``None``: no rings)."""
        return None

    def transport_bytes(self) -> dict[str, int] | None:
        """Result bytes the workers sent out of band, by way, since the
        executor started (``metrics()["dispatch"]["transport"]``); ``None``:
        results are handed over as objects (no serialisation to count)."""
        return None

    def ensure_alive(self) -> None:
        """Replace workers that died (or were given up) between runs."""
        for slot in self.slots:
            if slot.process is None or not slot.process.is_alive():
                self.replace(slot)

    @abc.abstractmethod
    def _start(self, slot: Slot) -> None: ...

    @abc.abstractmethod
    def set_run(self, run_id: int) -> None:
        """Workers skip chunks of runs before ``run_id``."""

    @abc.abstractmethod
    def send(self, slot: Slot, message: Encoded) -> bool:
        """Hand a chunk to the slot's worker (may block while its input is
        full); ``False`` when the worker is gone. Call with ``slot.send_lock``."""

    @abc.abstractmethod
    def send_control(self, slot: Slot, obj: Any) -> bool:
        """A control message (e.g. a state request); ``False`` if gone."""

    @abc.abstractmethod
    def wait(
        self, timeout: float, paused: frozenset[int] = frozenset(), reader: object = None
    ) -> list[Event]:
        """Messages and deaths, waiting at most ``timeout`` seconds; results
        of the ``paused`` slots are left with their workers for now (deaths
        are still reported). Nothing (an empty list) once ``reader`` is not
        the one :meth:`claim` named."""

    @abc.abstractmethod
    def interrupt(self) -> None:
        """Make a ``wait`` in progress return now (e.g. to stop)."""

    @abc.abstractmethod
    def replace(self, slot: Slot) -> None:
        """A fresh worker in ``slot`` (the old one killed if needed)."""

    @abc.abstractmethod
    def kill(self, slot: Slot) -> None:
        """Stop the slot's worker now, without waiting (processes only)."""

    @abc.abstractmethod
    def exit_text(self, slot: Slot) -> str:
        """How the slot's (dead) worker ended."""

    def exitcode(self, slot: Slot) -> int | None:
        """The exit status of the slot's (dead) worker, if it has one (a process)."""
        return None

    def startup_death_text(self) -> str:
        """Said after :meth:`exit_text` of a worker that died before it was
        ready: what to check (empty when there is nothing to add)."""
        return ""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop every worker within bounded time; idempotent. A close cut
        short (Ctrl-C) is finished by the next call: ``closed`` is set first
        (senders give up), ``shut`` once everything is released."""
