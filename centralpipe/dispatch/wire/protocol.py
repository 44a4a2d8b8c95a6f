"""What crosses the dispatch boundary: messages, chunks' items, results, and encoding.

Every message between the main process and a worker, and every copy of items
made for the worker stages, goes through the functions here; they are the
only callers of :mod:`centralpipe.dispatch.wire.transport` (serialisation and
framing), so a different transport plugs in at one place.

Messages (tuples, first element the kind):

- ``(MSG_CHUNK, run_id, stream_id, cid, epoch, first_seq, items, skip, per_item, rng_key)``
  main → worker; ``stream_id`` picks the worker chain (one per ordered
  stream: each parallel central stage, then the dispatch boundary)
- ``(MSG_RESULT, run_id, stream_id, cid, ChunkResult)`` worker → main
- ``(MSG_STATES,)`` main → worker, answered by ``(MSG_STATES, states)``

A chunk's items and a result's outputs travel *sealed*
(:class:`~centralpipe.dispatch.wire.transport.Sealed`): one that cannot be
unpickled on the other side arrives as an ``Undecodable`` inside an intact
message, so the receiver still knows which chunk it was. Such a chunk is sent
again ``per_item``: each item, and each input's outputs, sealed on its own, so
exactly the items that cannot cross fail (at the boundary stage for inputs,
at the last worker stage for outputs) and every item before them is delivered.

A worker also publishes its progress in a shared status array (``STATUS_*``
slots): the stream, ``seq`` and stage index of the item it is on and since
when, so the main process can time out a hung item and name the item that
killed a worker without asking it anything. The worker is the only writer; a
version counter (odd while a write is in progress) lets a reader retry
instead of reading a torn mix of two items (a seqlock).
"""

from __future__ import annotations

import itertools
import struct
import time
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from centralpipe.dispatch.wire import tokens, transport
from centralpipe.dispatch.wire.ringreader import Ring
from centralpipe.dispatch.wire.ringwriter import RingWriter

__all__ = [
    "MSG_CHUNK",
    "MSG_RESULT",
    "MSG_STATES",
    "STATUS_LEN",
    "STATUS_READY",
    "STATUS_SEQ",
    "STATUS_STAGE",
    "STATUS_STARTED",
    "STATUS_STREAM",
    "STATUS_VERSION",
    "ChunkResult",
    "Encoded",
    "StageFailure",
    "Undecodable",
    "chunk_message",
    "copy_items",
    "decode",
    "encode",
    "exception_text",
    "group_outputs",
    "picklable_error",
    "read_status",
    "recv",
    "recv_counted",
    "seal_outputs",
    "send",
    "send_encoded",
    "send_result",
    "status_begin",
    "status_idle",
    "status_stage",
    "unseal_outputs",
    "writable_status",
]

MSG_CHUNK = 1
MSG_RESULT = 2
MSG_STATES = 3

# status slots shared between a worker and the main process
STATUS_VERSION, STATUS_SEQ, STATUS_STARTED, STATUS_STAGE, STATUS_STREAM, STATUS_READY = range(6)
STATUS_LEN = 6
#: Reads of a status array retried while the worker is writing it.
_STATUS_READ_TRIES = 1000


def writable_status(raw: Any) -> Any:
    """A worker's view of its status slots (a shared ``RawArray("d")``) for
    writing: a memoryview of its doubles, whose item writes cost a third of
    the ctypes array's (one status write per item and stage). The same
    bytes: the main process reads the array itself (:func:`read_status`)."""
    try:
        return memoryview(raw).cast("B").cast("d")
    except (TypeError, ValueError):  # not a buffer of doubles (a thread's list)
        return raw


def status_begin(status: Any, stream: int, seq: int, stage: int) -> None:
    """The worker starts item ``seq`` of ``stream`` at stage index ``stage``."""
    v = status[STATUS_VERSION]
    status[STATUS_VERSION] = v + 1
    status[STATUS_SEQ] = seq
    status[STATUS_STREAM] = stream
    status[STATUS_STAGE] = stage
    status[STATUS_STARTED] = time.monotonic()
    status[STATUS_VERSION] = v + 2


def status_stage(status: Any, stage: int) -> None:
    """The worker moves on to stage index ``stage`` of the same item."""
    v = status[STATUS_VERSION]
    status[STATUS_VERSION] = v + 1
    status[STATUS_STAGE] = stage
    status[STATUS_VERSION] = v + 2


def status_idle(status: Any) -> None:
    """The worker finished its chunk."""
    v = status[STATUS_VERSION]
    status[STATUS_VERSION] = v + 1
    status[STATUS_STARTED] = 0.0
    status[STATUS_VERSION] = v + 2


def read_status(status: Any) -> tuple[int, int, int, float] | None:
    """``(stream, seq, stage index, started)`` of the item a worker is on, or
    ``None`` when it is idle; never a torn mix of two items."""
    for _ in range(_STATUS_READ_TRIES):
        v = status[STATUS_VERSION]
        if int(v) % 2:
            continue
        started = status[STATUS_STARTED]
        values = (int(status[STATUS_STREAM]), int(status[STATUS_SEQ]), int(status[STATUS_STAGE]))
        if status[STATUS_VERSION] != v:
            continue
        return None if not started else (*values, started)
    return None  # pragma: no cover - a writer stuck mid-write (killed): idle


Undecodable = transport.Undecodable
exception_text = transport.exception_text


class StageFailure(NamedTuple):
    """An exception raised by a worker stage for one input of a chunk
    (or recorded by the main process for it: then ``text`` is the whole
    message and ``exitcode`` the exit code of the worker it killed)."""

    at: int  # input index within the chunk
    stage: str | None
    exc_type: str
    message: str
    traceback: str
    text: str = ""
    exitcode: int | None = None


class ChunkResult(NamedTuple):
    """What a chunk of inputs became.

    ``outputs`` is flat; ``counts[i]`` is how many outputs input ``i`` made
    (``None``: exactly one each); ``failures`` lists inputs whose stage raised.
    """

    outputs: list[Any]
    counts: list[int] | None
    failures: list[StageFailure] | None
    elapsed_s: float


class Encoded(NamedTuple):
    """A message serialised once, ready to be written to a connection."""

    head: bytes
    buffers: list[memoryview]


def encode(obj: Any) -> Encoded:
    """Serialise ``obj`` (raises whatever pickling raises)."""
    message = transport.dumps(obj)
    return Encoded(message.head, message.buffers)


def send_encoded(conn: Connection, message: Encoded) -> None:
    """Write an encoded message (blocks while the pipe is full)."""
    transport.write(conn, transport.Message(message.head, message.buffers))


def send(conn: Connection, obj: Any, ring: RingWriter | None = None) -> None:
    """Encode and write one message (large buffers into ``ring`` if given)."""
    transport.send(conn, obj, ring)


# The prefix of a plain result message: run id, stream id, chunk id, elapsed s.
_PLAIN_RESULT = struct.Struct("<qqqd")


def send_result(
    conn: Connection,
    run_id: int,
    stream: int,
    cid: int,
    result: ChunkResult,
    per_item: bool,
    ring: RingWriter | None = None,
    flat: bool = True,
) -> None:
    """Write a chunk's ``MSG_RESULT``: with no pickle when its outputs are
    all plain tensors or arrays already in ``ring`` (one per input, no
    failure; see :mod:`~centralpipe.dispatch.wire.plain`), else pickled with its
    outputs sealed (``flat``: see :func:`seal_outputs`; raises whatever
    pickling raises)."""
    if ring is not None and not per_item and result.counts is None and not result.failures:
        prefix = _PLAIN_RESULT.pack(run_id, stream, cid, result.elapsed_s)
        message = transport.dumps_plain(prefix, result.outputs)
        if message is not None:
            transport.write(conn, message, ring)
            return
    sealed = seal_outputs(result, per_item, flat)
    transport.send(conn, (MSG_RESULT, run_id, stream, cid, sealed), ring)


def _unplain(obj: Any) -> Any:
    """A received plain message as the ``MSG_RESULT`` it stands for."""
    if type(obj) is not transport.Plain:
        return obj
    try:
        run_id, stream, cid, elapsed = _PLAIN_RESULT.unpack(obj.prefix)
    except struct.error:
        raise EOFError("a plain message without a result prefix") from None
    return (MSG_RESULT, run_id, stream, cid, ChunkResult(obj.outputs, None, None, elapsed))


def recv(conn: Connection, ring: Ring | None = None) -> Any:
    """Read one message written by :func:`send` / :func:`send_encoded` /
    :func:`send_result` (``ring``: the sender's shared-memory ring, see
    :mod:`~centralpipe.dispatch.wire.ringreader`)."""
    return _unplain(transport.recv(conn, ring))


def recv_counted(conn: Connection, ring: Ring | None = None) -> tuple[Any, int]:
    """:func:`recv`, and the bytes the message takes in this process."""
    obj, nbytes = transport.recv_counted(conn, ring)
    return _unplain(obj), nbytes


def chunk_message(
    run_id: int,
    stream: int,
    cid: int,
    epoch: int,
    first_seq: int,
    items: list[Any],
    skip: frozenset[int],
    per_item: bool,
    rng_key: tuple[int, int],
    flat_groups: bool = True,
) -> tuple[tuple[Any, ...], list[tokens.Flat] | None]:
    """The ``MSG_CHUNK`` message of chunk ``cid`` (of stream ``stream``) with
    these items, and the flat buffers they went as when every item is one
    (else ``None``); with ``flat_groups``, an item that is a list of 1-D
    arrays or tensors travels as one buffer plus offsets
    (:mod:`~centralpipe.dispatch.wire.tokens`)."""
    # A byte range of lines (``worker.ranges.LineRange``) goes as its fields:
    # its lines are read by the worker, never here.
    flats: list[tokens.Flat] | None = None
    if flat_groups and isinstance(items, list):
        items = [_flat_or_same(x) for x in items]
        # (no generator here: an interrupt at its start would be swallowed by all())
        if set(map(type, items)) == {tokens.Flat}:
            flats = items
    sealed: Any = [transport.Sealed(x) for x in items] if per_item else transport.Sealed(items)
    message = (MSG_CHUNK, run_id, stream, cid, epoch, first_seq, sealed, skip, per_item, rng_key)
    return message, flats


def _flat_or_same(items: Any) -> Any:
    flat = tokens.flatten(items)
    return items if flat is None else flat


def group_outputs(result: ChunkResult) -> ChunkResult:
    """The result with its outputs grouped per input (a list per input)."""
    counts = result.counts or [1] * len(result.outputs)
    groups = []
    pos = 0
    for n in counts:
        groups.append(result.outputs[pos : pos + n])
        pos += n
    return ChunkResult(groups, list(counts), result.failures, result.elapsed_s)


def seal_outputs(result: ChunkResult, per_item: bool, flat: bool = True) -> ChunkResult:
    """The result as a worker sends it: outputs sealed whole, or per input;
    with ``flat``, outputs that are all 1-D arrays or tensors of one dtype
    travel as one buffer plus offsets (:mod:`~centralpipe.dispatch.wire.tokens`)."""
    if not per_item:
        outputs = _flat_or_same(result.outputs) if flat else result.outputs
        return result._replace(outputs=transport.Sealed(outputs))  # type: ignore[arg-type]
    grouped = group_outputs(result)
    return grouped._replace(outputs=[transport.Sealed(g) for g in grouped.outputs])


def unseal_outputs(result: ChunkResult, stage: str | None, boundary: str) -> ChunkResult:
    """A per-item result as the main process delivers it: inputs whose outputs
    cannot be unpickled fail at ``stage``; inputs that could not be unpickled
    in the worker (stage ``None``) fail at ``run``."""
    failures = [
        f if f.stage is not None else f._replace(stage=boundary) for f in result.failures or ()
    ]
    outputs: list[Any] = []
    counts: list[int] = []
    for i, group in enumerate(result.outputs):
        if isinstance(group, Undecodable):
            text = f"its result cannot be unpickled in the main process: {group.message}"
            failures.append(StageFailure(i, stage, group.exc_type, text, ""))
            counts.append(0)
        else:
            outputs.extend(group)
            counts.append(len(group))
    failures.sort(key=lambda f: f.at)
    return ChunkResult(outputs, counts, failures or None, result.elapsed_s)


def decode(message: Encoded) -> Any:
    """Inverse of :func:`encode` (a fresh copy of the object)."""
    return transport.loads(message.head, [bytearray(b) for b in message.buffers])


def copy_items(items: list[Any], flat_groups: bool = True) -> list[Any]:
    """A serialised round trip of ``items``: what a worker would receive
    (``flat_groups``: as :func:`chunk_message` sends them)."""
    # A byte range of lines (``worker.ranges.LineRange``) goes as its fields:
    # its lines are read by the worker, never here.
    if flat_groups and isinstance(items, list):
        items = [_flat_or_same(x) for x in items]
        same = _copy_int_lists(items)
        if same is not None:
            return same
    copied: list[Any] = transport.copy(items)
    return copied


def _copy_int_lists(items: list[Any]) -> list[Any] | None:
    """``items`` copied as a pickle round trip would rebuild them, when they
    are lists of plain ``int`` (token lists) or lists of such lists (buckets
    of them): the common inline case, at a fraction of the round trip's
    cost. ``None`` otherwise, and when a list object is met twice (pickle
    would keep the two as one)."""
    if set(map(type, items)) != {list}:
        return None
    inner = list(itertools.chain.from_iterable(items))
    kinds = set(map(type, inner))
    if kinds <= {int}:  # token lists
        if len(set(map(id, items))) != len(items):
            return None
        return list(map(list, items))
    if kinds != {list} or set(map(type, itertools.chain.from_iterable(inner))) - {int}:
        return None
    if len({*map(id, items), *map(id, inner)}) != len(items) + len(inner):
        return None
    return [list(map(list, group)) for group in items]


def picklable_error(obj: Any, *, roundtrip: bool = False) -> Exception | None:
    """``None`` when ``obj`` can be serialised (and, with ``roundtrip``,
    unpickled again), else the exception."""
    try:
        if roundtrip:
            transport.copy(obj)
        else:
            transport.dumps(obj)
    except Exception as exc:
        return exc
    return None
