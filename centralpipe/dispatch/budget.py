"""The bytes of results held in the main process before their turn.

Results come back in whatever order the workers finish, and wait on their
chunk until the consumer reaches them. ``buffer_size`` bounds them in items;
a straggling worker would still let the others' results pile up in bytes
(1 MB results behind one slow item grow the main process by gigabytes). A
:class:`ResultBytes` counts them — the one place that knows how many bytes a
received result holds — against the bound (``WorkerConfig.buffer_bytes``),
in two ways, neither of which can deadlock:

- *sending* (``may_pull``): a stream pulls a new chunk only while the bytes
  held plus the bytes its sent, unanswered items will bring (each stream's
  measured bytes per item, kept in its ``StreamStats``) stay under the bound;
  until a stream's first result tells its size, one chunk at a time. A
  stream with nothing pending may always pull: the chunk everyone waits for
  is always made;
- *receiving* (``paused``), for what the estimate missed: once the bound is
  reached the supervisor stops reading the workers that owe nothing the
  consumers wait for. It keeps reading every worker that owes the first
  chunk without a result of some stream (the straggler's result, and every
  result before it, is always accepted), every worker a send is in progress
  to (so the sending thread never stays blocked on a full pipe), and every
  worker while a state request is answered or the run stops. A paused
  process writes into its pipe until that is full and then waits; a paused
  thread waits before handing over its result.

So the held bytes stay about under the bound: beyond it by at most the
results that were already owed before the consumer's position when it was
reached, and an estimate's error (a single result larger than the bound is
still accepted, alone). A bound of ``None`` changes nothing.

A result's bytes are what receiving it allocated in the main process: the
size of the message read from a worker process, and for a thread worker
(whose outputs are not copied) an estimate of its outputs
(:func:`estimate_nbytes`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["ResultBytes", "estimate_nbytes"]

#: How deep :func:`estimate_nbytes` looks into nested containers.
_ESTIMATE_DEPTH = 4
#: Weight of the newest result in a stream's bytes-per-item estimate.
_NEW_WEIGHT = 0.3


class ResultBytes:
    """Bytes of received, not yet delivered results of one run (every stream).

    ``add`` is called by the supervisor thread when it puts a result on its
    chunk, ``release`` by the thread delivering the chunk; both take a small
    lock of their own. ``on_room`` is called (outside the lock) when the held
    bytes fall back under the bound, so a paused supervisor reads again at once.
    ``stats`` keeps ``bytes_high_water`` (the most bytes held at once) across runs.
    """

    def __init__(
        self, limit: int | None, on_room: Callable[[], None] | None = None, stats: Any = None
    ) -> None:
        self.limit = limit
        self.held = 0
        self.stats = stats
        #: The streams of the run (each with ``in_flight``, ``pending`` and ``stats``).
        self.streams: list[Any] = []
        self._held_items: dict[int, int] = {}  # stream id -> inputs whose result is held
        self._on_room = on_room
        self._lock = threading.Lock()

    def add(self, stream: Any, chunk: Any, nbytes: int) -> None:
        """``chunk`` of ``stream`` got its result, of ``nbytes`` bytes."""
        items = len(chunk.items)
        with self._lock:
            chunk.hold_bytes(nbytes)
            self.held += nbytes
            sid = stream.stream_id
            self._held_items[sid] = self._held_items.get(sid, 0) + items
            if self.stats is not None and self.held > self.stats.bytes_high_water:
                self.stats.bytes_high_water = self.held
            if items:
                per_item = nbytes / items
                old = stream.stats.bytes_per_item
                stream.stats.bytes_per_item = (
                    per_item if old < 0 else (1 - _NEW_WEIGHT) * old + _NEW_WEIGHT * per_item
                )

    def release(self, stream: Any, chunk: Any) -> None:
        """``chunk`` was delivered: its bytes are no longer held. Idempotent:
        a retirement cut short by Ctrl-C is done again by the next ``next()``."""
        if chunk.result is None or chunk.held_bytes < 0:
            return
        with self._lock:
            # Every call first (a Ctrl-C is handled as one returns, or as a
            # Python function starts), the chunk's release last of them (an
            # interrupt lands at its entry, before its write, or not at all),
            # then the two writes with no call: released whole or not at all.
            was_full = self.full()
            sid = stream.stream_id
            items = self._held_items.get(sid, 0) - len(chunk.items)
            nbytes = chunk.release_bytes()
            self.held = self.held - nbytes
            self._held_items[sid] = items
            room = was_full and not self.full()
        if room and self._on_room is not None:
            self._on_room()

    def full(self) -> bool:
        """The bound is reached: the supervisor pauses what it can."""
        return self.limit is not None and self.held >= self.limit

    def may_pull(self, stream: Any) -> bool:
        """Whether ``stream`` may pull (and send) a new chunk now."""
        if self.limit is None or not stream.pending:
            return True
        promised = 0.0
        for other in self.streams:
            owed = other.in_flight - self._held_items.get(other.stream_id, 0)
            per_item = other.stats.bytes_per_item
            if per_item < 0:
                if other is stream and owed > 0:
                    return False  # size unknown: one chunk at a time until it is
                continue
            promised += per_item * owed
        return self.held + promised < self.limit

    def paused(self, slots: Iterable[Any]) -> frozenset[int]:
        """Slot indexes whose results are not read now (see the module docstring)."""
        if not self.full():
            return frozenset()
        needed: set[int] = set()
        for stream in self.streams:
            for chunk in list(stream.pending):
                if chunk.result is None:
                    needed.add(chunk.slot)  # -1 while not yet sent: none needed
                    break
        return frozenset(s.index for s in slots if s.index not in needed and not s.sending)


def estimate_nbytes(obj: Any, depth: int = _ESTIMATE_DEPTH) -> int:
    """Approximate memory of ``obj``: the data of tensors and arrays, the
    length of strings and bytes, containers walked ``depth`` levels deep,
    ``sys.getsizeof`` for anything else."""
    nbytes = getattr(obj, "nbytes", None)  # numpy arrays, memoryviews
    if isinstance(nbytes, int):
        return nbytes
    if hasattr(obj, "untyped_storage") and hasattr(obj, "element_size"):  # torch tensors
        return int(obj.element_size() * obj.numel())
    if isinstance(obj, (bytes, bytearray, str)):
        return len(obj)
    if depth > 0:
        if isinstance(obj, dict):
            return sum(estimate_nbytes(v, depth - 1) for v in obj.values()) + sys.getsizeof(obj)
        if isinstance(obj, (list, tuple, set, frozenset)):
            return sum(estimate_nbytes(v, depth - 1) for v in obj) + sys.getsizeof(obj)
    return sys.getsizeof(obj)
