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
  progress; they wait at most :data:`CENTRAL_WAIT_S`, then raise
  ``TimeoutError`` naming the stage that is inside ``next()`` (never an inexact
  state).
- ``close()``, ``metrics()`` and stopping a run never wait for it: they only
  take the short bookkeeping locks of the streams.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Collection, Sequence
from types import CodeType, FrameType
from typing import Any

__all__ = ["CENTRAL_WAIT_S", "Holding", "busy_stage", "hold", "join_started"]

#: Longest wait of ``state_dict()``, ``query()``, ``load_state_dict()`` and the
#: start of a pass for a central ``next()`` in progress (seconds).
CENTRAL_WAIT_S = 60.0
#: How long a thread whose ``start()`` was interrupted may take to show up
#: (one that shows up later finds its run stopped and ends at once).
_START_GRACE_S = 0.2


class Holding:
    """``with hold(lock, what, nodes):`` the chain lock, or ``TimeoutError``."""

    def __init__(self, lock: threading.Lock, what: str, nodes: Sequence[Any]) -> None:
        self.lock = lock
        self.what = what
        self.nodes = nodes

    # The lock's own acquire and release are called right here, not through
    # helper methods: a Ctrl-C is taken at the entry of a Python function, and
    # one landing at the entry of a helper called from ``__exit__`` would keep
    # the chain locked for good (every later pass and state_dict() then times
    # out). Between the C-level acquire and the ``with`` block, and in here
    # before the release, no Python function is entered.

    def __enter__(self) -> None:
        started = time.monotonic()
        if not self.lock.acquire(timeout=CENTRAL_WAIT_S):
            raise TimeoutError(_busy_text(self.what, self.nodes, time.monotonic() - started))

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def hold(lock: threading.Lock, what: str, nodes: Sequence[Any]) -> Holding:
    """Hold ``lock`` (a chain lock) for ``what``, waiting at most
    :data:`CENTRAL_WAIT_S`; ``nodes`` are the chain's nodes (to name the
    stage that keeps it in the error)."""
    return Holding(lock, what, nodes)


def busy_stage(
    nodes: Sequence[Any], ident: int | None = None, unless: Collection[CodeType] = ()
) -> tuple[Any, int] | None:
    """The innermost of ``nodes`` that a thread (``ident``, or any other
    than the caller) is running, and that thread's ident; ``None`` if none
    is, or if the thread is running one of the functions ``unless`` inside
    it (e.g. a send to a worker).

    Read from the threads' stacks, so the chain pays nothing per item."""
    ids = {id(n) for n in nodes}
    me = threading.get_ident()
    for tid, frame in sys._current_frames().items():
        if tid == me or (ident is not None and tid != ident):
            continue
        node = _innermost(frame, ids, unless)
        if node is not None:
            return node, tid
    return None


def _innermost(frame: FrameType | None, ids: set[int], unless: Collection[CodeType]) -> Any:
    while frame is not None:
        if frame.f_code in unless:
            return None
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
        f"(the bound is centralpipe.dispatch.guard.CENTRAL_WAIT_S = {CENTRAL_WAIT_S:g} s). "
        "Nothing was changed; call it again once the stage returns."
    )


def join_started(thread: threading.Thread, timeout: float) -> None:
    """Join ``thread``, whose ``start()`` was called but may have been
    interrupted (Ctrl-C) before or after the thread began: wait for it to
    show up for a short grace, then for it to end, at most ``timeout``."""
    deadline = time.monotonic() + timeout
    grace = time.monotonic() + min(timeout, _START_GRACE_S)
    while True:
        try:
            thread.join(max(0.0, deadline - time.monotonic()))
            return
        except RuntimeError:  # not started (yet)
            if time.monotonic() > grace:
                return
            time.sleep(0.001)
