"""Starting the worker processes in the background, when the Loader is created.

With ``forkserver`` a worker's start waits for the server to be ready (it
imports what :mod:`centralpipe.dispatch.executors.preload` chose) and with ``spawn``
each worker boots a fresh interpreter: either takes from a tenth of a second
to a few seconds. A :class:`BackgroundStart` runs ``Executor.start`` in a
``centralpipe-starter`` thread as soon as the Loader exists, so the workers
boot while the program does other work (builds its model); they wait idle for
their first chunk, and the first pass only sends work.

``fork`` workers are not started this way: forking from a thread while the
caller's thread runs user code is unsafe, and a fork takes milliseconds.

Lifetime: the thread holds the executor, never the Loader, so a Loader that is
never iterated can be garbage-collected; its finalizer (or ``close()``) calls
:meth:`BackgroundStart.cancel`, which stops the start after the worker being
started, waits for the thread (bounded) and closes whatever started. A start
that failed is raised by :meth:`BackgroundStart.result` at the first pass,
with a note saying where it happened; that pass starts nothing, and the next
one starts the workers afresh.
"""

from __future__ import annotations

import threading
from multiprocessing.connection import wait

from centralpipe.dispatch import timeouts
from centralpipe.dispatch.executors.pool import Executor, Slot

__all__ = ["BACKGROUND_METHODS", "BackgroundStart"]

#: Start methods whose workers start in the background.
BACKGROUND_METHODS = ("forkserver", "spawn")


class BackgroundStart:
    """``pool.start()`` in a thread; see the module docstring."""

    def __init__(self, pool: Executor) -> None:
        self.pool = pool
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="centralpipe-starter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.pool.start(self._stop.is_set)
        except BaseException as exc:  # handed to the first pass
            self.error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def workers_ready(self) -> bool:
        """The start is over and every worker got to its receive loop (or
        died: the run's supervisor replaces it), or the start failed: either
        way :meth:`result` no longer waits. With ``spawn`` a worker process
        exists long before it is ready (it imports what it needs first)."""
        if not self.done():
            return False
        if self.error is not None:
            return True
        # A loop, not all() over a generator: a Ctrl-C landing as a generator
        # left unfinished is finalized is ignored ("Exception ignored in").
        for slot in self.pool.slots:  # noqa: SIM110
            if not (slot.ready() or not _alive(slot)):
                return False
        return True

    def result(self) -> Executor:
        """The started executor, once every worker has started (waits for the
        thread); the start's error, if it failed, with the pool closed."""
        self._thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            self.pool.close()  # no half-started pool: the next pass starts afresh
            error.add_note(
                "(raised while starting the workers in the background, when the Loader was "
                "created; the next iteration starts them again)"
            )
            raise error
        return self.pool

    def cancel(self) -> None:
        """Stop the start (after the worker being started), wait for the
        thread, and close whatever started; idempotent."""
        self._stop.set()
        self._thread.join(timeouts.CANCEL_JOIN_TIMEOUT_S)
        # Past the timeout the thread is still inside one worker's start: the
        # pool's pipe ends close here, so that worker exits on its own.
        self.pool.close()


def _alive(slot: Slot) -> bool:
    """The slot's worker process runs (read from its sentinel, which no
    other thread waits on before the run's supervisor starts)."""
    proc = slot.process
    if proc is None:
        return False
    try:
        return not wait([proc.sentinel], 0)
    except (ValueError, OSError):  # closed
        return False
