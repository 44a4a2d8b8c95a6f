"""A bucket's heap in checkpoints: sealed segments, so ``state_dict()`` costs what changed.

``bucket_by_max_tokens`` buffers tens of thousands of token arrays in a heap
of ``(length, arrival, item)`` entries. Encoding them afresh at every
``state_dict()`` concatenates every array (tens of milliseconds for 25k);
:class:`HeapArena` keeps them instead as *segments*: the arrays pushed
between two states concatenated once (:mod:`centralpipe.checkpoint.compact`
parts), their ``length`` and ``arrival`` columns, and a ``live`` mask of
the entries still in the heap. A state seals the entries pushed since the
last one into a new segment and clears the mask bits of the entries popped
since, so it costs the entries that changed, not the buffer. Segments are
immutable once made (a new mask replaces an old one: an earlier state is
never changed behind its holder's back); adjacent segments merge while the
older holds at most twice the live entries of the newer, and a segment
whose entries are more than half dead is rewritten with the live ones only,
so there are O(log n) segments and the saved bytes stay within about twice
the live tokens.

The encoded heap, one leaf for ``torch.distributed.checkpoint`` like every
compact value::

    ("compact", 2, {"segments": [segment, ...]})
    segment = {compact part keys..., "length": Tensor, "arrival": Tensor,
               "live": bool Tensor}

(:func:`encode_entries` writes the same from a list of entries.) A heap
whose items are not 1-D arrays stays the plain list ``[[length, arrival,
item], ...]``; :func:`decode_heap` reads all of these and the first compact
format's ``{"length", "arrival", "items"}`` dict.
"""

from __future__ import annotations

from itertools import pairwise
from operator import itemgetter
from typing import Any

import numpy as np
import torch

from centralpipe.checkpoint import compact
from centralpipe.dispatch.wire.tokens import flatten

__all__ = ["HeapArena", "decode_heap", "encode_entries"]

_SEGMENTS = "segments"
_COLUMNS = ("length", "arrival", "live")
_SEGMENT_KEYS = sorted({*compact.PART_KEYS, *_COLUMNS})
_GET_LENGTH, _GET_ARRIVAL, _GET_ITEM = itemgetter(0), itemgetter(1), itemgetter(2)
_ARRAY_TYPES = (np.ndarray, torch.Tensor)
#: Pending entries sealed by the bucket itself past max(this, live entries).
_SEAL_AT = 4096


class _Segment:
    """Entries in arrival order: their items' values, lengths, columns and
    live mask (numpy), and ``part``, the saved form (built once per mask)."""

    __slots__ = ("arrival", "key", "length", "live", "n_live", "part", "sizes", "values")

    def __init__(
        self,
        key: tuple[str, str, bool],
        values: Any,
        sizes: Any,
        length: Any,
        arrival: Any,
        live: Any,
    ) -> None:
        self.key = key  # (kind, dtype, writeable)
        self.values = values  # numpy, narrowed
        self.sizes = sizes  # int64 numpy: each item's number of values
        self.length = length  # int64 numpy: len_fn's length
        self.arrival = arrival  # int64 numpy, increasing
        self.live = live  # bool numpy, never written after this
        self.n_live = int(np.count_nonzero(live))
        kind, dtype, writeable = key
        self.part = {
            "kind": kind,
            "dtype": dtype,
            "writeable": writeable,
            "values": torch.from_numpy(values),
            "lengths": compact.narrow(torch.from_numpy(sizes)),
            "groups": None,
            "length": compact.narrow(torch.from_numpy(length)),
            "arrival": compact.narrow(torch.from_numpy(arrival)),
            "live": torch.from_numpy(live),
        }

    def with_dead(self, index: Any) -> _Segment:
        """This segment with the entries at ``index`` (distinct, live) dead:
        a new mask, every other column shared."""
        live = self.live.copy()
        live[index] = False
        out = _Segment.__new__(_Segment)
        out.key, out.values, out.sizes = self.key, self.values, self.sizes
        out.length, out.arrival, out.live = self.length, self.arrival, live
        out.n_live = self.n_live - len(index)
        out.part = {**self.part, "live": torch.from_numpy(live)}
        return out


def _segment(entries: list[Any]) -> _Segment | None:
    """The segment of ``entries`` (all live), or ``None`` when their items do
    not flatten into one buffer (not 1-D arrays of one dtype)."""
    flat = flatten(list(map(_GET_ITEM, entries)), min_items=1)
    if flat is None:
        return None
    n = len(entries)
    if flat.kind == "numpy":
        values, dtype = flat.flat, str(flat.flat.dtype)
    else:
        values, dtype = flat.flat.numpy(), str(flat.flat.dtype).removeprefix("torch.")
        if dtype == "bfloat16":  # numpy has none: kept whole, never narrowed
            return None
    values = compact.narrow(torch.from_numpy(values)).numpy()
    return _Segment(
        (flat.kind, dtype, flat.writeable),
        values,
        np.diff(flat.ends, prepend=0),
        np.fromiter(map(_GET_LENGTH, entries), dtype=np.int64, count=n),
        np.fromiter(map(_GET_ARRIVAL, entries), dtype=np.int64, count=n),
        np.ones(n, dtype=bool),
    )


def _merged(segments: list[_Segment]) -> _Segment:
    """One segment of the live entries of ``segments`` (of one key, in order)."""
    values, sizes, length, arrival = [], [], [], []
    for s in segments:
        live = s.live
        values.append(s.values[np.repeat(live, s.sizes)])
        sizes.append(s.sizes[live])
        length.append(s.length[live])
        arrival.append(s.arrival[live])
    flat = compact.narrow(torch.from_numpy(np.concatenate(values))).numpy()
    n = sum(map(len, arrival))
    return _Segment(
        segments[0].key,
        flat,
        np.concatenate(sizes),
        np.concatenate(length),
        np.concatenate(arrival),
        np.ones(n, dtype=bool),
    )


def _tidy(segments: list[_Segment]) -> list[_Segment]:
    """Drop empty segments, rewrite the mostly dead ones, merge neighbours
    until each holds more than twice the live entries of the next."""
    out: list[_Segment] = []
    for s in segments:
        if not s.n_live:
            continue
        if 2 * s.n_live < len(s.live):
            s = _merged([s])
        while out and out[-1].key == s.key and out[-1].n_live <= 2 * s.n_live:
            s = _merged([out.pop(), s])
        out.append(s)
    return out


class HeapArena:
    """The bucket heap's entries as segments (see the module).

    Dormant (``off``) until the first state of an epoch asks for the heap:
    that one encodes the whole heap into one segment (a pipeline that never
    checkpoints pays nothing per item). From then on the bucket appends each
    entry it pushes to ``pending`` and each arrival it pops to ``removed``,
    each just before the heap call; ``count()`` is then the heap's length
    (one off, by which the bucket's ``_settle`` finishes an interrupted push
    or pop). ``pending`` is sealed at each state, and by the bucket when it
    outgrows :meth:`full` (so rare checkpoints hold no more than about the
    heap again). Items that do not flatten leave it dormant: the heap is
    saved by :func:`encode_entries`."""

    __slots__ = ("live", "off", "pending", "removed", "segments")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.segments: list[_Segment] = []
        self.pending: list[Any] = []  # entries pushed since the last seal, by arrival
        self.removed: list[int] = []  # arrivals popped since the last seal
        self.live = 0  # live entries in ``segments``
        self.off = True

    def count(self) -> int:
        return self.live + len(self.pending) - len(self.removed)

    def full(self) -> bool:
        """Whether ``pending`` is due a seal before the next push."""
        return len(self.pending) > max(_SEAL_AT, self.live)

    def state(self, heap: list[Any]) -> Any:
        """The encoded heap (the whole of ``heap`` is read only when dormant)."""
        if self.off:
            return self._start(heap)
        if not self.seal():
            return encode_entries(heap)
        if not self.segments:
            return []
        return (compact.COMPACT_KEY, compact.FORMAT, {_SEGMENTS: [s.part for s in self.segments]})

    def _start(self, heap: list[Any]) -> Any:
        if not heap or type(heap[0][2]) not in _ARRAY_TYPES:
            return list(heap)
        seg = _segment(sorted(heap, key=_GET_ARRIVAL))
        if seg is None:
            return list(heap)
        # No call between the writes: an interrupt leaves it dormant or started.
        self.segments, self.pending, self.removed, self.live, self.off = (
            [seg],
            [],
            [],
            len(heap),
            False,
        )
        return (compact.COMPACT_KEY, compact.FORMAT, {_SEGMENTS: [seg.part]})

    def seal(self) -> bool:
        """Fold ``pending`` and ``removed`` into the segments; ``False`` (and
        dormant) when the pending items do not flatten."""
        segments = list(self.segments)
        pending = self.pending
        if pending:
            new = _segment(pending)
            if new is None:
                # No call between the writes: see the bucket's Ctrl-C notes.
                off, live = True, 0
                self.off, self.segments, self.pending, self.removed, self.live = (
                    off,
                    [],
                    [],
                    [],
                    live,
                )
                return False
            segments.append(new)
        removed = self.removed
        if removed:
            segments = _remove(segments, np.asarray(removed, dtype=np.int64))
        segments = _tidy(segments)
        live = sum(s.n_live for s in segments)
        # No call between the writes: an interrupt leaves the old or the new arena.
        self.segments, self.pending, self.removed, self.live = segments, [], [], live
        return True


def _remove(segments: list[_Segment], arrivals: Any) -> list[_Segment]:
    """``segments`` with the entries of ``arrivals`` marked dead."""
    arrivals.sort()
    firsts = np.array([s.arrival[0] for s in segments], dtype=np.int64)
    which = np.searchsorted(firsts, arrivals, side="right") - 1
    bounds = np.searchsorted(which, np.arange(len(segments) + 1))
    out = []
    for i, s in enumerate(segments):
        a, b = int(bounds[i]), int(bounds[i + 1])
        if a == b:
            out.append(s)
            continue
        out.append(s.with_dead(np.searchsorted(s.arrival, arrivals[a:b])))
    return out


def encode_entries(entries: list[Any]) -> Any:
    """A list of heap entries as one segment when its items flatten, else
    the plain list (a copy)."""
    if not entries:
        return []
    ordered = sorted(entries, key=_GET_ARRIVAL)
    seg = _segment(ordered)
    if seg is None:
        return list(entries)
    return (compact.COMPACT_KEY, compact.FORMAT, {_SEGMENTS: [seg.part]})


def _entries_of(part: Any) -> list[list[Any]]:
    if not isinstance(part, dict) or set(part) != {*compact.PART_KEYS, *_COLUMNS}:
        keys = sorted(part) if isinstance(part, dict) else type(part).__name__
        raise ValueError(f"a heap segment must have the keys {_SEGMENT_KEYS}, got {keys}")
    items = compact.decode_part({k: part[k] for k in compact.PART_KEYS})
    columns = []
    for key in _COLUMNS:
        column = part[key]
        if not isinstance(column, torch.Tensor) or column.dim() != 1 or len(column) != len(items):
            n = len(items)
            raise ValueError(f"compact {key} must be a 1-D tensor of one value per item ({n})")
        if (key == "live") != (column.dtype == torch.bool) or column.is_floating_point():
            raise ValueError(f"compact {key} of dtype {column.dtype} is not known")
        columns.append(column.tolist())
    length, arrival, live = columns
    return [[n, i, item] for n, i, alive, item in zip(length, arrival, live, items) if alive]


def decode_heap(value: Any) -> Any:
    """The heap entries ``[[length, arrival, item], ...]`` an encoded heap
    stands for; any other value as it is (for the caller to judge).
    ``ValueError`` for a damaged one."""
    if isinstance(value, dict):  # the first compact format
        return compact.decode_keyed(value, ("length", "arrival"))
    if not compact.is_compact(value):
        return value
    body = compact.encoded_body(value, dict)
    if set(body) != {_SEGMENTS} or not isinstance(body[_SEGMENTS], list):
        raise ValueError(f"a compact heap must be {{'segments': [...]}}, got keys {sorted(body)}")
    entries = [e for part in body[_SEGMENTS] for e in _entries_of(part)]
    arrivals = [e[1] for e in entries]
    if any(a >= b for a, b in pairwise(arrivals)):
        raise ValueError("compact heap arrivals must increase")
    if (arrivals and arrivals[0] < 0) or any(e[0] < 0 for e in entries):
        raise ValueError("compact heap lengths and arrivals must be >= 0")
    return entries
