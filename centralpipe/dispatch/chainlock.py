"""The central chain's lock, and bounded waits on it.

Every central stage's ``next()`` (user code: a source may block on a network
read, a parallel stage waits for its workers) runs under one *chain lock* per
Loader, held by the one thread running the chain (the feeder, or the
consumer). It is the only lock ever held across user code, and it outlives
runs: a feeder of a stopped run that is still inside a blocking ``next()``
keeps it until that call returns, so a new pass never runs the chain (or
resets its stages) beside it.

What needs the chain lock, and the bound:

- ``state_dict()``, ``query()``, ``load_state_dict()`` and the start of a pass
  read or reset the central stages, so they must wait for the ``next()`` in
  progress; they wait at most :data:`centralpipe.config.CENTRAL_WAIT_S`, then raise
  ``TimeoutError`` naming the stage that is inside ``next()`` (never an inexact
  state).
- ``close()``, ``metrics()``, ``query(delivered=True)`` and stopping a run
  never wait for it: they only take the short bookkeeping locks of the
  streams. Nor does the live ``query()`` of a stage that publishes a
  :meth:`~centralpipe.stages.base.CentralNode.live_view` (a ``count``: its
  last ``(items, weight)``, one immutable tuple).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from centralpipe import config
from centralpipe.dispatch import timeouts

__all__ = [
    "Holding",
    "Wake",
    "busy_stage",
    "hold",
    "join_started",
    "new_chain_lock",
]


def new_chain_lock() -> threading.RLock:
    """A chain lock: an ``RLock``, for its owner check (``release()`` by a
    thread that does not hold it raises ``RuntimeError``), never entered
    twice by one thread."""
    return threading.RLock()


class Holding:
    """``with hold(lock, what, nodes):`` the chain lock, or ``TimeoutError``.

    No interrupt can leave the lock held. CPython handles a signal (runs the
    Python handler: the ``KeyboardInterrupt``) at a Python function's entry,
    after a call into C returns and on a loop's backward jump, never inside
    one C call. So:

    - the release is the lock's own C-level ``__exit__``, which the ``with``
      statement looks up (``__exit__`` below is a property, read by ``with``
      before ``__enter__`` runs) and calls without entering any Python
      function; a Python ``__exit__`` could be interrupted at its entry,
      before it releases;
    - ``__enter__`` takes the lock in a ``try``: an interrupt landing as the
      acquire returns (the lock taken, ``__enter__`` not yet returned, so the
      ``with`` would never call ``__exit__``) is caught there, and the lock
      released by this thread (``RLock.release()`` raises instead of
      releasing another thread's hold) before it is re-raised;
    - from ``__enter__``'s return into the ``with`` block, and from the
      block into the C-level release, no Python function runs.
    """

    __slots__ = ("lock", "nodes", "readers", "what")

    def __init__(
        self, lock: threading.RLock, what: str, nodes: Sequence[Any], readers: Any = None
    ) -> None:
        self.lock = lock
        self.what = what
        self.nodes = nodes
        #: An object whose ``waiting_readers`` counts the threads waiting for the
        #: lock (under its ``readers_lock``): the central thread yields to them.
        self.readers = readers

    def __enter__(self) -> None:
        lock, readers = self.lock, self.readers
        started = time.monotonic()
        counted = False
        try:
            if readers is not None:
                with readers.readers_lock:
                    readers.waiting_readers += 1
                    counted = True
            got = lock.acquire(True, config.CENTRAL_WAIT_S)
        except BaseException:
            # Interrupted in the wait (not taken), or as the acquire returned
            # (taken): release it if this thread has it, then re-raise.
            try:
                lock.release()
            except RuntimeError:
                pass
            raise
        finally:
            if counted:
                with readers.readers_lock:
                    readers.waiting_readers -= 1
        if not got:
            raise TimeoutError(_busy_text(self.what, self.nodes, time.monotonic() - started))

    @property
    def __exit__(self) -> Callable[..., Any]:
        """The lock's own (C-level) ``__exit__``: it releases the lock."""
        return self.lock.__exit__


class Wake:
    """Wakes every thread waiting in :meth:`wait_unless` at
    :meth:`notify_all`; the one wake-up of a run (``Supervisor.wake``).

    Not a ``threading.Condition``: its ``__enter__``, ``__exit__`` and
    ``wait()`` are Python code between C-level lock operations, so a Ctrl-C
    in the consumer can leave its lock held (the supervisor's next notify
    then blocks for good) or released under a ``with`` that releases it
    again. Here every lock is a C-level ``with`` held for a few statements,
    and a waiter waits on a lock of its own, holding nothing: an interrupt
    anywhere leaves at most a stale waiter, which the next notify drops."""

    __slots__ = ("_lock", "_waiters")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: list[Any] = []

    def wait_unless(self, ready: Callable[[], bool], timeout: float) -> None:
        """Wait at most ``timeout`` for a notify, unless ``ready()``. The
        waiter is registered before ``ready()`` is read, so no notify between
        the two is lost."""
        waiter = threading.Lock()
        waiter.acquire()
        with self._lock:
            self._waiters.append(waiter)
        try:
            if not ready():
                waiter.acquire(True, timeout)
        finally:
            with self._lock:
                try:
                    self._waiters.remove(waiter)
                except ValueError:  # taken by a notify
                    pass

    def notify_all(self) -> None:
        """Wake every waiting thread (any thread may call it)."""
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.release()


def hold(lock: threading.RLock, what: str, nodes: Sequence[Any]) -> Holding:
    """Hold ``lock`` (a chain lock) for ``what``, waiting at most
    :data:`centralpipe.config.CENTRAL_WAIT_S`; ``nodes`` are the chain's nodes (to name the
    stage that keeps it in the error)."""
    return Holding(lock, what, nodes)


def busy_stage(nodes: Sequence[Any], ident: int | None = None) -> tuple[Any, int] | None:
    """The innermost of ``nodes`` that a thread (``ident``, or any other
    than the caller) is running, and that thread's ident; ``None`` if none is.

    Read from the threads' stacks, so the chain pays nothing per item; used
    to name the stage in an error, never to decide what to do."""
    ids = {id(n) for n in nodes}
    me = threading.get_ident()
    for tid, frame in sys._current_frames().items():
        if tid == me or (ident is not None and tid != ident):
            continue
        node = _innermost(frame, ids)
        if node is not None:
            return node, tid
    return None


def _innermost(frame: FrameType | None, ids: set[int]) -> Any:
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in ids:
            return owner
        frame = frame.f_back
    return None


def _busy_text(what: str, nodes: Sequence[Any], waited_s: float) -> str:
    found = busy_stage(nodes)
    if found is None:
        where = "the central chain stayed busy"
    elif getattr(found[0], "parallel", False):
        where = f"parallel stage '{found[0].name}' is still waiting for its workers"
    else:
        where = f"central stage '{found[0].name}' has not returned from next()"
    return (
        f"{what} waited {waited_s:.1f} s for the central chain and gave up: {where} "
        f"(the bound is centralpipe.config.CENTRAL_WAIT_S = {config.CENTRAL_WAIT_S:g} s). "
        "Nothing was changed; call it again once the stage returns."
    )


def join_started(thread: threading.Thread, timeout: float) -> None:
    """Join ``thread``, whose ``start()`` was called but may have been
    interrupted (Ctrl-C) before or after the thread began: wait for it to
    show up for a short grace, then for it to end, at most ``timeout``."""
    deadline = time.monotonic() + timeout
    grace = time.monotonic() + min(timeout, timeouts.START_GRACE_S)
    while True:
        try:
            thread.join(max(0.0, deadline - time.monotonic()))
            return
        except RuntimeError:  # not started (yet)
            if time.monotonic() > grace:
                return
            time.sleep(0.001)
