"""What a Loader must release, and the finalizer that releases it.

:class:`Resources` holds the worker pool (or its start in the background,
``dispatch.starter``), the current run, the pin thread,
the central nodes (open files) and the chain lock, apart from the Loader, so
that a ``weakref.finalize`` can release them once the Loader is garbage
collected. ``close()`` runs the same code.

The finalizer takes no lock. Garbage collection may run it in any thread, at
any allocation, including in one of the Loader's own threads (the feeder in
the middle of a central ``next()``, the supervisor, the pin thread, a thread
worker) while that thread holds one of the Loader's locks; closing there
would wait on a lock the thread itself holds. So in those threads it only
sets the run's stop flags (plain attribute writes) and hands the close to a
short-lived ``centralpipe-closer`` thread. Any other thread cannot hold the
locks of a Loader nobody references (a thread inside the Loader's code keeps
it alive), so there — the caller's ``close()``, garbage collection in the
caller's thread, interpreter exit — it closes at once.
"""

from __future__ import annotations

import threading
from multiprocessing.connection import wait
from typing import Any

from centralpipe.dispatch.chainlock import new_chain_lock
from centralpipe.dispatch.executors.pool import Executor
from centralpipe.dispatch.executors.starter import BackgroundStart
from centralpipe.dispatch.pinning import Pinner
from centralpipe.dispatch.run import Run
from centralpipe.stages import CentralNode

__all__ = ["OWN_THREAD_PREFIX", "Resources"]

#: The names of every thread centralpipe starts begin with this.
OWN_THREAD_PREFIX = "centralpipe-"


class Resources:
    """See the module docstring."""

    def __init__(self) -> None:
        self.pool: Executor | None = None
        #: The workers' start in the background, until the first pass takes its pool.
        self.starter: BackgroundStart | None = None
        self.run: Run | None = None
        self.pinner: Pinner | None = None
        self.nodes: list[CentralNode[Any]] = []
        #: Held across every central ``next()`` (see dispatch.chainlock).
        self.chain_lock = new_chain_lock()

    def end_run(self) -> None:
        """Stop the current run (bounded). It stays registered until it has
        stopped, so an interrupted stop is finished by the next call."""
        run = self.run
        if run is not None:
            run.stop()
            self.run = None

    def worker_pids(self) -> list[int]:
        """Process ids of the live worker processes."""
        pool = self.pool
        if pool is None or pool.kind != "process":
            return []
        pids = []
        for slot in pool.slots:
            proc = slot.process  # read once: the supervisor may be replacing it
            try:
                # Its sentinel, not is_alive(): under forkserver is_alive()
                # reads the exit status from the sentinel, and a read racing
                # the supervisor's would block forever once the other took it.
                if proc is not None and not wait([proc.sentinel], 0):
                    pids.append(proc.pid)
            except (ValueError, OSError):  # closed by a concurrent replacement
                continue
        return pids

    def finalize(self) -> None:
        """The Loader's finalizer (and ``close()``); takes no lock in the
        Loader's own threads (see the module docstring)."""
        if not threading.current_thread().name.startswith(OWN_THREAD_PREFIX):
            self.close()
            return
        run = self.run
        if run is not None:
            run.abandon()
        closer = threading.Thread(target=self.close, name="centralpipe-closer", daemon=True)
        try:
            closer.start()
        except RuntimeError:  # pragma: no cover - interpreter shutting down
            pass

    def close(self) -> None:
        """Release everything, within bounded time; idempotent. A call cut
        short (Ctrl-C) is finished by the next: each part stays registered
        until it is released."""
        # Each step runs even if an earlier one fails (e.g. Ctrl-C mid-drain),
        # but the pool only once the run's threads, which use it, are stopped.
        try:
            self.end_run()
        finally:
            try:
                self.end_run()
                if self.starter is not None:
                    self.starter.cancel()
                    self.starter = None
                if self.pool is not None:
                    self.pool.close()
                    self.pool = None
            finally:
                if self.pinner is not None:
                    self.pinner.close()
                # Files are closed unless a stopped run's thread is still
                # inside a central next(): then they close with the nodes.
                # Taken inside the try, and released by this thread if it has
                # it, not if a flag says so: an interrupt landing as the
                # acquire returns comes before any flag is set.
                try:
                    if self.nodes and self.chain_lock.acquire(blocking=False):
                        self.nodes[-1].release()
                finally:
                    try:
                        self.chain_lock.release()
                    except RuntimeError:  # not taken
                        pass
