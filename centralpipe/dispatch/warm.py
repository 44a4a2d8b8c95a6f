"""Inline warm start (opt-in): the main process runs the first chunks while the workers start.

Off by default (``WorkerConfig.start_inline=False``): with ``num_workers > 0``
user code runs only in the workers, as with torch's DataLoader, and the first
``next()`` waits for them. A ``forkserver`` or ``spawn`` pool starts in the
background when the Loader is created (:mod:`centralpipe.dispatch.executors.starter`),
but its workers may need a second or more (a forkserver importing torch, each
spawned worker importing it). With ``start_inline=True`` a pass that begins
before they are ready does not wait for them: a :class:`WarmDriver` runs the
dispatch stream in the consumer's thread
(:class:`~centralpipe.dispatch.sender.InlineDriver`: the consumer pulls a
chunk and runs the worker stages, the same seeds, ``on_error`` and skipped
counts), and parallel central stages inline too. Every chunk run so goes
through the workers' serialisation both ways
(:func:`~centralpipe.dispatch.sender.run_as_worker`): the items as a worker
would receive them, the result as the main process would receive it from a
worker, so an item or a result that cannot cross the boundary fails the
same way whoever ran it. Output, order, errors and checkpoints are those of
the workers: the worker stages depend only on ``(item, seed, epoch, seq)``,
and a checkpoint is the central states plus the pending chunks, whoever runs
them. What is lost is the isolation: a crash (``os._exit``, a segfault) or a
hang of the function ends or blocks the main process, and a CUDA context,
memory or threads the function makes stay in it.

Before each chunk it asks whether every worker is ready (a thread-liveness
check and a read of each worker's status: microseconds). Chunks aim at
``TARGET_CHUNK_S`` of work (``dispatch.pull``), so the main process stops
running items within about one chunk of the workers being up. Then it
*hands over* (:meth:`~centralpipe.dispatch.run.Run.hand_over`), in the
consumer's thread, at a chunk boundary: no chunk is half run (a chunk a
Ctrl-C cut short is run inline first, so nothing pending lacks a result),
the session's supervisor starts, parallel stages switch to their
:class:`~centralpipe.dispatch.sender.SegmentDriver` and the feeder thread
starts pulling and sending; the chunks already run inline are delivered
first, in order. Every step of the hand-over can be repeated, so a Ctrl-C
anywhere in it is raised at once and the next ``next()`` finishes it. A
background start that failed is raised there, with its note; the next
``next()`` starts the workers again (waiting for them) and goes on.

Until then no thread of the run exists: no feeder or supervisor to starve.
Because inline items lose a worker's isolation the Loader only warms up this
way when ``WorkerConfig.start_inline`` is on, ``timeout_s`` is not set (a
hung item could not be stopped), no worker stage is stateful, and the start
method is ``forkserver`` or ``spawn`` (``fork`` workers start in
milliseconds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from centralpipe.dispatch.chunk import Chunk
from centralpipe.dispatch.executors.pool import Executor
from centralpipe.dispatch.reorder import Driver, Stream
from centralpipe.dispatch.sender import InlineDriver

__all__ = ["WarmDriver", "WarmStart"]


class WarmStart:
    """Where a warm run finds its workers: ``ready()`` says whether they are
    all up (or failed: then ``acquire`` raises), ``acquire()`` returns the
    started executor (or raises the start's error) without waiting once
    ``ready()`` is true; ``num_workers`` sizes the chunks as for the pool."""

    def __init__(
        self, ready: Callable[[], bool], acquire: Callable[[], Executor], num_workers: int
    ) -> None:
        self.ready = ready
        self.acquire = acquire
        self.num_workers = num_workers


class WarmDriver(Driver):
    """The dispatch stream's driver while the workers start; see the module
    docstring. Once handed over, the stream's driver is the pool's and this
    one only finishes the call in progress.

    The run that owns ``stream`` owns the hand-over too: ``hand_over(executor)``
    (repeatable, see :meth:`~centralpipe.dispatch.run.Run.hand_over`)
    replaces ``stream.driver``, and ``stop()`` ends the run's session. This
    driver only decides *when*."""

    def __init__(
        self,
        stream: Stream,
        warm: WarmStart,
        *,
        hand_over: Callable[[Executor], None],
        stop: Callable[[], None],
    ) -> None:
        self.stream = stream
        self.warm = warm
        self._hand_over = hand_over
        self._stop = stop
        self.inline = InlineDriver(stream, as_worker=True)
        #: The hand-over began: it is finished (never undone) by the next call.
        self.handing_over = False
        #: Chunks up to this id are counted in ``inline_items``.
        self._counted = -1

    def wait_head(self) -> Chunk | None:
        s = self.stream
        if self.handing_over or (self._settled() and self.warm.ready()):
            self.handing_over = True
            self._hand_over(self.warm.acquire())
            driver = s.driver
            assert driver is not None and driver is not self
            return driver.wait_head()
        chunk = self.inline.wait_head()
        if chunk is not None and chunk.cid > self._counted:
            self._counted = chunk.cid
            s.stats.inline_items += len(chunk.items)
        return chunk

    def _settled(self) -> bool:
        """Every pending chunk of the dispatch stream has its result (none
        was cut short while run inline)."""
        s = self.stream
        with s.lock:
            return all(chunk.result is not None for chunk in s.pending)

    def stop(self) -> None:
        self._stop()

    def worker_states(self) -> list[Any] | None:
        return None
