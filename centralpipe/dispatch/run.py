"""One pass over the central chain: chunks, delivery order, and the checkpoint.

A run pulls items from the tip of the central chain, numbers them (``seq``),
groups them into chunks, has the worker stages run each chunk (inline, or in a
worker process — see :mod:`centralpipe.dispatch.feeder`), and yields outputs in
``seq`` order. ``pending`` holds every chunk pulled but not yet fully
delivered; with the central stages' state it is the whole checkpoint.

Invariant: every item the central chain produced is either delivered, or in a
pending chunk — under ``lock``, always both or neither.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import operator
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from centralpipe.dispatch import transport
from centralpipe.dispatch.chain import ChunkResult, StageFailure, WorkerChain
from centralpipe.errors import WorkerError
from centralpipe.stages import CentralNode, Count, Shard

__all__ = ["Chunk", "InFlight", "Run", "RunStats"]

logger = logging.getLogger("centralpipe")

#: A chunk being filled is sent after this long even if not full.
FLUSH_S = 0.02
#: The feeder releases the lock at least this often while pulling.
LOCK_SLICE_S = 0.0005
#: Work per chunk the adaptive chunk size aims at.
TARGET_CHUNK_S = 0.005
MAX_CHUNK = 1024
FIRST_CHUNK = 16
#: Most items pulled between two looks at the clock.
PULL_BURST = 32


class Chunk:
    """Consecutive dispatched items (``first_seq`` …) sent as one message."""

    __slots__ = (
        "cid",
        "closed",
        "first_seq",
        "items",
        "raised_at",
        "result",
        "sent_gen",
        "skip",
        "skip_first",
        "slot",
        "stamps",
        "unsendable",
    )

    def __init__(self, cid: int, first_seq: int, stamped: bool) -> None:
        self.cid = cid
        self.first_seq = first_seq
        self.items: list[Any] = []
        self.stamps: list[Any] | None = [] if stamped else None
        self.slot = -1
        self.sent_gen = -1
        self.result: ChunkResult | None = None
        self.skip: set[int] = set()  # input indexes not to run (poison items)
        self.skip_first = 0  # outputs of input 0 delivered before a resume
        self.closed = False
        self.raised_at = -1  # input whose failure was raised to the consumer
        # inputs that cannot be pickled: failures at the dispatch stage
        self.unsendable: list[StageFailure] = []


class InFlight:
    """The in-flight part of a checkpoint: inputs to dispatch again first."""

    def __init__(
        self,
        first_seq: int,
        items: list[Any],
        stamps: list[Any] | None,
        skip_outputs: int,
        skip: Sequence[int],
    ) -> None:
        self.first_seq = first_seq
        self.items = items
        self.stamps = stamps
        self.skip_outputs = skip_outputs
        self.skip = set(skip)


class RunStats:
    """Counters that outlive one run (the Loader's ``metrics()``)."""

    def __init__(self, num_slots: int) -> None:
        self.dispatched = 0
        self.delivered = 0
        self.skipped = 0
        self.restarts = 0
        self.epoch_restarts = 0
        self.high_water = 0
        self.wait_workers_s = 0.0
        self.wait_central_s = 0.0
        self.items_per_worker = [0] * num_slots
        self.chunk_size = FIRST_CHUNK


class Run(abc.ABC):
    """Delivery, checkpoint capture and chunk pulling; subclasses obtain results."""

    def __init__(
        self,
        *,
        nodes: Sequence[CentralNode[Any]],
        chain: WorkerChain,
        epoch: int,
        next_seq: int,
        resume: InFlight | None,
        delivered_stamp: Any,
        buffer_size: int | None,
        chunk_size: int | None,
        on_error: str,
        stats: RunStats,
        dispatch_name: str,
        parallelism: int,
    ) -> None:
        self.nodes = list(nodes)
        self.tip = nodes[-1]
        self.chain = chain
        self.epoch = epoch
        self.next_seq = next_seq
        self.buffer_size = buffer_size
        self.fixed_chunk = chunk_size
        self.on_error = on_error
        self.stats = stats
        self.dispatch_name = dispatch_name
        self.parallelism = max(1, parallelism)
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.pending: deque[Chunk] = deque()
        self.by_cid: dict[int, Chunk] = {}
        self.next_cid = 0
        self.in_flight = 0
        self.exhausted = False
        self.central_error: BaseException | None = None
        self.finished = False
        self.broken = False
        self.stopping = False
        self.cost_per_item = 0.0
        self._burst = 1
        self._readers = 0
        self._stamped = [n for n in nodes if isinstance(n, (Count, Shard))]
        self._resume: deque[tuple[int, Any, Any]] = deque()
        self._resume_skip: set[int] = set()
        self._resume_skip_first = (-1, 0)
        if resume is not None:
            stamps = resume.stamps or [None] * len(resume.items)
            for k, (item, stamp) in enumerate(zip(resume.items, stamps)):
                self._resume.append((resume.first_seq + k, item, stamp))
            self._resume_skip = set(resume.skip)
            self._resume_skip_first = (resume.first_seq, resume.skip_outputs)
        self.last_stamp = delivered_stamp if delivered_stamp is not None else self._stamp_now()
        # Delivery position inside the current chunk.
        self.current: Chunk | None = None
        self._cur_list: list[Any] = []
        self._cur_it: Iterator[Any] | None = None
        self._cur_base = 0

    # -- stamps ----------------------------------------------------------------

    def _stamp_now(self) -> Any:
        if not self._stamped:
            return None
        return tuple(
            (n.items, n.weight) if isinstance(n, Count) else n.index for n in self._stamped
        )

    def stamped_nodes(self) -> list[CentralNode[Any]]:
        return self._stamped

    # -- pulling (under the lock, in short slices) -----------------------------

    def target_chunk(self) -> int:
        if self.fixed_chunk is not None:
            n = self.fixed_chunk
        elif self.cost_per_item <= 0:
            n = FIRST_CHUNK
        else:
            n = max(1, min(MAX_CHUNK, int(TARGET_CHUNK_S / self.cost_per_item)))
        if self.buffer_size is not None:
            n = min(n, max(1, self.buffer_size // (2 * self.parallelism)))
        self.stats.chunk_size = n
        return n

    def pull_chunk(self) -> Chunk | None:
        """Pull up to one chunk of items; ``None`` when nothing is left (or
        stopping). The chunk is in ``pending`` from its first item on."""
        target = self.target_chunk()
        stamped = bool(self._stamped)
        with self.lock:
            if self.exhausted or self.stopping:
                return None
            if self.buffer_size is not None:
                target = max(1, min(target, self.buffer_size - self.in_flight))
            first_seq = self._resume[0][0] if self._resume else self.next_seq
            chunk = Chunk(self.next_cid, first_seq, stamped)
            self.next_cid += 1
            self.pending.append(chunk)
            self.by_cid[chunk.cid] = chunk
        started = time.perf_counter()
        nxt = self.tip.next
        items, stamps = chunk.items, chunk.stamps
        append = items.append
        while True:
            if self._readers:
                # Lock hand-off is not fair: drop the GIL so a waiting
                # state_dict()/query() gets the lock before we take it again.
                time.sleep(0)
            with self.lock:
                if self.stopping:
                    break
                t0 = time.perf_counter()
                slice_end = t0 + LOCK_SLICE_S
                while self._resume and len(items) < target:
                    seq, item, stamp = self._resume.popleft()
                    if seq in self._resume_skip:
                        chunk.skip.add(len(items))
                    if seq == self._resume_skip_first[0]:
                        chunk.skip_first = self._resume_skip_first[1]
                    if stamps is not None:
                        stamps.append(stamp if stamp is not None else self._stamp_now())
                    append(item)
                    self.in_flight += 1
                before = len(items)
                try:
                    while len(items) < target:
                        # Pull in short bursts; look at the clock between them.
                        for _ in range(min(self._burst, target - len(items))):
                            item = nxt()
                            if stamps is not None:
                                stamps.append(self._stamp_now())
                            append(item)
                        if time.perf_counter() > slice_end:
                            break
                except StopIteration:
                    self.exhausted = True
                except BaseException as exc:  # a central stage failed
                    self.central_error = exc
                    self.exhausted = True
                added = len(items) - before
                if added:
                    # Slow central stages get a look at the clock after every
                    # item, so the lock is never held much past LOCK_SLICE_S.
                    per_item = max(1e-9, (time.perf_counter() - t0) / added)
                    self._burst = max(1, min(PULL_BURST, int(LOCK_SLICE_S / per_item / 4)))
                self.next_seq += added
                self.in_flight += added
                self.stats.wait_central_s += time.perf_counter() - t0
                if self.in_flight > self.stats.high_water:
                    self.stats.high_water = self.in_flight
                done = self.exhausted or len(items) >= target
                if done or time.perf_counter() - started > FLUSH_S:
                    if not items:
                        self.pending.remove(chunk)
                        del self.by_cid[chunk.cid]
                        return None
                    chunk.closed = True
                    self.stats.dispatched += len(items)
                    return chunk
        # stopping: leave the chunk in pending (the run is abandoned anyway)
        return None

    # -- results ---------------------------------------------------------------

    def copy_items(self, chunk: Chunk) -> list[Any]:
        """The chunk's items as a worker stage sees them: a pickled copy.

        Inline (``num_workers=0``) this keeps a stage that mutates its item in
        place from changing the checkpoint's in-flight items, as a worker
        process would. Items that cannot be pickled become ``None`` and are
        failures of the dispatch stage (:meth:`sendable_items`)."""
        try:
            head, buffers = transport.dumps(chunk.items)
        except Exception:
            head, buffers = transport.dumps(self.sendable_items(chunk))
        copied: list[Any] = transport.loads(head, [bytearray(b) for b in buffers])
        return copied

    def sendable_items(self, chunk: Chunk) -> list[Any]:
        """Items with each one that cannot be pickled replaced by ``None`` and
        recorded in ``chunk.unsendable`` (the rest of the chunk goes on)."""
        items = list(chunk.items)
        chunk.unsendable = []
        for i, item in enumerate(items):
            try:
                transport.dumps(item)
            except Exception as exc:
                text = (
                    "an item from the central stages cannot be pickled for the worker "
                    f"stages: {exc}"
                )
                chunk.unsendable.append(
                    StageFailure(i, self.dispatch_name, type(exc).__name__, text, "")
                )
                items[i] = None
        return items

    def run_skip(self, chunk: Chunk) -> frozenset[int]:
        """Inputs the worker stages must not run: poison and unsendable items."""
        return frozenset(chunk.skip).union(f.at for f in chunk.unsendable)

    def accept(self, chunk: Chunk, result: ChunkResult) -> ChunkResult:
        """Bookkeeping for a chunk's result before it is delivered."""
        if chunk.unsendable:
            failures = sorted([*(result.failures or ()), *chunk.unsendable], key=lambda f: f.at)
            result = result._replace(
                failures=failures, counts=result.counts or [1] * len(chunk.items)
            )
        if result.elapsed_s > 0 and chunk.items:
            per_item = result.elapsed_s / len(chunk.items)
            self.cost_per_item = (
                per_item if self.cost_per_item <= 0 else 0.7 * self.cost_per_item + 0.3 * per_item
            )
        if chunk.skip_first:
            k = chunk.skip_first
            counts = result.counts or [1] * len(chunk.items)
            counts = [max(0, counts[0] - k), *counts[1:]]
            result = result._replace(outputs=result.outputs[k:], counts=counts)
        if result.failures and self.on_error == "skip":
            for failure in result.failures:
                self.stats.skipped += 1
                logger.warning(
                    "skipping item seq %d: worker stage '%s' raised %s: %s",
                    chunk.first_seq + failure.at,
                    failure.stage,
                    failure.exc_type,
                    failure.message,
                )
            result = result._replace(failures=None, counts=result.counts or [1] * len(chunk.items))
        return result

    # -- delivery --------------------------------------------------------------

    @abc.abstractmethod
    def wait_head(self) -> Chunk | None:
        """The oldest pending chunk once its result is in; ``None`` at the end."""

    def outputs(self) -> Iterator[Any]:
        """Outputs in ``seq`` order; raises the central stage's exception (after
        delivering everything before it) or a ``WorkerError``."""
        while True:
            if self.stopping:
                raise RuntimeError(
                    "this iterator was superseded: iter(loader), load_state_dict() or close() "
                    "was called since it started; iterate the loader again."
                )
            chunk = self.wait_head()
            if chunk is None:
                break
            result = chunk.result
            assert result is not None
            self.current = chunk
            self._cur_base = 0
            self._cur_list = result.outputs
            it = iter(result.outputs)
            self._cur_it = it
            if result.failures is None:
                yield from it
            else:
                yield from self._deliver_failing(chunk, result, it)
            self._retire(chunk)
        if self.central_error is not None:
            # Not finished: a checkpoint now resumes after the item the central
            # stage raised on (that item was consumed by the failing stage).
            self.broken = True
            self.stop()
            raise self.central_error
        self.finished = True
        self.stop()

    def _deliver_failing(
        self, chunk: Chunk, result: ChunkResult, it: Iterator[Any]
    ) -> Iterator[Any]:
        failed = {f.at: f for f in result.failures or ()}
        counts = result.counts or [1] * len(chunk.items)
        for i, n in enumerate(counts):
            f = failed.get(i)
            if f is not None:
                chunk.raised_at = i
                self.broken = True
                seq = chunk.first_seq + i
                msg = f"worker stage '{f.stage}' raised {f.exc_type} on item seq {seq}: {f.message}"
                raise WorkerError(
                    msg,
                    stage=f.stage,
                    seq=seq,
                    exc_type=f.exc_type,
                    remote_traceback=f.traceback or None,
                )
            for _ in range(n):
                try:
                    yield next(it)
                except StopIteration:  # stop() ended the chunk: superseded
                    return

    def _retire(self, chunk: Chunk) -> None:
        with self.cond:
            self.pending.popleft()
            self.by_cid.pop(chunk.cid, None)
            self.in_flight -= len(chunk.items)
            if chunk.stamps:
                self.last_stamp = chunk.stamps[-1]
            self.stats.delivered += len(chunk.result.outputs) if chunk.result else 0
            self.current = None
            self._cur_it = None
            self.cond.notify_all()

    def _delivered_in_current(self) -> int:
        it = self._cur_it
        if it is None:
            return 0
        return self._cur_base + len(self._cur_list) - operator.length_hint(it)

    def _split_current(self, chunk: Chunk) -> tuple[int, int, int]:
        """(first input not fully delivered, outputs of it delivered, input of
        the last delivered output or -1) for the chunk being delivered."""
        d = self._delivered_in_current() if chunk is self.current else 0
        result = chunk.result
        if result is None or (d == 0 and chunk is not self.current):
            return 0, 0, -1
        counts = result.counts
        if counts is None and result.failures is None:
            return d, 0, d - 1
        counts = counts or [1] * len(chunk.items)
        done = 0
        last = -1
        for i, n in enumerate(counts):
            if i == chunk.raised_at or done + n > d:
                return i, d - done, (i if d > done else last)
            done += n
            if n:
                last = i
        return len(counts), 0, last

    # -- checkpoint ------------------------------------------------------------

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the lock to read state. The feeder yields to waiting readers
        between pull slices, so a reader waits at most about one slice."""
        self._readers += 1
        try:
            with self.lock:
                yield
        finally:
            self._readers -= 1

    def capture(self) -> dict[str, Any]:
        """The checkpoint of this run at the consumer's position (under the lock)."""
        with self.reading():
            central = {node.name: node.own_state() for node in self.nodes}
            items: list[Any] = []
            stamps: list[Any] | None = [] if self._stamped else None
            skip: list[int] = []
            first_seq = self.next_seq
            skip_outputs = 0
            delivered_stamp = self.last_stamp
            first = True
            for chunk in self.pending:
                if not chunk.items:
                    continue  # being filled: nothing pulled into it yet
                start = 0
                if first:
                    j, k, last = self._split_current(chunk)
                    start, skip_outputs = j, k
                    if last >= 0 and chunk.stamps:
                        delivered_stamp = chunk.stamps[last]
                    first_seq = chunk.first_seq + j
                    first = False
                    if chunk.skip_first and j == 0:
                        skip_outputs += chunk.skip_first
                items.extend(chunk.items[start:])
                if stamps is not None and chunk.stamps is not None:
                    stamps.extend(chunk.stamps[start:])
                skip.extend(chunk.first_seq + i for i in chunk.skip if i >= start)
            if self._resume:
                if first:
                    first_seq = self._resume[0][0]
                for seq, item, stamp in self._resume:
                    items.append(item)
                    if stamps is not None:
                        stamps.append(stamp)
                    if seq in self._resume_skip:
                        skip.append(seq)
                if first and self._resume_skip_first[0] == first_seq:
                    skip_outputs = self._resume_skip_first[1]
            if self.finished:
                delivered_stamp = self._stamp_now()
            return {
                "central": central,
                "next_seq": self.next_seq,
                "in_flight": {
                    "first_seq": first_seq,
                    "items": items,
                    "stamps": stamps,
                    "skip_outputs": skip_outputs,
                    "skip": skip,
                },
                "delivered_stamp": delivered_stamp,
                "finished": self.finished,
            }

    def delivered_stamp(self) -> Any:
        """Stamp of the count/shard stages as of the last delivered output."""
        with self.reading():
            if self.finished:
                return self._stamp_now()
            chunk = self.current
            if chunk is not None and chunk.stamps:
                _, _, last = self._split_current(chunk)
                if last >= 0:
                    return chunk.stamps[last]
            return self.last_stamp

    def stop(self) -> None:
        """Abandon or finish the run; idempotent. An iterator still delivering
        a chunk stops at its next item and raises (see ``outputs``)."""
        with self.cond:
            self.stopping = True
            it = self._cur_it
            if it is not None and not self.finished:
                it.__setstate__(len(self._cur_list))  # type: ignore[attr-defined]
            self.cond.notify_all()

    def delivered_in_chunk(self) -> int:
        """Outputs of the current chunk already delivered (for metrics)."""
        return self._delivered_in_current() if self.current is not None else 0
