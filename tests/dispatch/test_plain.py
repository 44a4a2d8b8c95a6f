"""Results that cross without pickle (``dispatch.plain``) and the ring's batched releases.

A chunk whose every output is a plain tensor or array already in the
worker's ring is sent as a table of integers; these tests check that each
listed dtype and shape arrives exactly as the pickled path (and
``num_workers=0``) gives it, that everything else still takes the pickled
path unchanged, that a damaged table is refused like a dead worker, that a
worker killed in the middle of such a chunk loses nothing, and that freed
results give their ring space back in batches, at the latest at the next
flush.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import centralpipe as cp
from centralpipe.dispatch.wire import plain, protocol, ringreader, ringwriter, transport
from tests.dispatch.test_transport import describe
from tests.fns.faulty import _first_time

pytestmark = pytest.mark.skipif(not ringreader.available(), reason="no os.memfd_create here")

#: Elements per output: 64 KiB of float32, past ``MIN_RING_BUFFER_BYTES``.
NUMEL = 16384


@pytest.fixture
def link() -> Iterator[tuple[ringreader.Ring, ringwriter.RingWriter, Any, Any]]:
    """A ring, the writer on it, and the pipe's two ends, all in this process."""
    ring = ringreader.Ring(2**23)
    a, b = multiprocessing.Pipe(duplex=True)
    try:
        assert ring.hand_over(a)
        writer = ringwriter.receive_ring(b)
        yield ring, writer, b, a
    finally:
        a.close()
        b.close()
        ring.close()


def _cross(link: Any, outputs: list[Any]) -> tuple[list[Any], bool]:
    """``outputs`` stashed, sent as a worker sends a result and received:
    what the main process delivers, and whether it went without pickle."""
    ring, writer, worker_end, main_end = link
    kept = [ringwriter.stash(x, writer) for x in outputs]
    result = protocol.ChunkResult(kept, None, None, 0.25)
    protocol.send_result(worker_end, 7, 0, 3, result, False, writer)
    writer.forget()
    head = main_end.recv_bytes()
    was_plain = struct.unpack_from("<I", head)[0] == 0xFFFFFFFF
    # Put the header back in front of the rest: parse it as the supervisor does.
    ring_spans = [(w, s) for s, _, w in transport._parse(head)[1]]
    buffers = ring.take_many(ring_spans)
    obj = protocol._unplain(transport.loads(head, buffers))
    kind, run_id, stream, cid, got = obj
    assert (kind, run_id, stream, cid) == (protocol.MSG_RESULT, 7, 0, 3)
    assert got.counts is None and got.failures is None
    return got.outputs, was_plain


def _torch_dtypes() -> list[torch.dtype]:
    return [getattr(torch, n) for n in plain.TORCH_DTYPES if hasattr(torch, n)]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * dtype.itemsize,), generator=g)
    t = raw.to(torch.uint8).view(dtype).reshape(shape)
    return t.clone()  # its own storage, exactly its bytes


SHAPES = [(NUMEL,), (128, 128), (4, 64, 64)]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", _torch_dtypes(), ids=str)
def test_every_listed_torch_dtype_crosses_without_pickle(link: Any, dtype: torch.dtype) -> None:
    """Tensors of each listed dtype and of 1 to 3 dimensions arrive without
    pickle, bit for bit, with their dtype, shape and strides, writable and
    each on memory of its own."""
    outputs = [_tensor(dtype, shape, k) for k, shape in enumerate(SHAPES)]
    expected = [describe(t) for t in outputs]
    got, was_plain = _cross(link, outputs)
    assert was_plain
    assert [describe(t) for t in got] == expected
    assert len({t.untyped_storage().data_ptr() for t in got}) == len(got)
    got[0].view(torch.uint8)[0] ^= 1  # writable, and only its own memory
    assert describe(got[1]) == expected[1]


@pytest.mark.parametrize("char", list(plain.NUMPY_CHARS))
def test_every_listed_numpy_dtype_crosses_without_pickle(link: Any, char: str) -> None:
    """numpy arrays of each listed dtype arrive without pickle, exact, with
    their dtype (its character too), shape, strides and writability."""
    dtype = np.dtype(char)
    rng = np.random.default_rng(0)
    outputs = []
    for k, shape in enumerate(SHAPES):
        a = np.frombuffer(rng.bytes(int(np.prod(shape)) * dtype.itemsize), dtype).reshape(shape)
        a = a.copy()
        if k == 1:
            a.flags.writeable = False
        outputs.append(a)
    got, was_plain = _cross(link, outputs)
    assert was_plain
    assert [describe(a) for a in got] == [describe(a) for a in outputs]
    assert [a.dtype.char for a in got] == [char] * len(SHAPES)


def _cases() -> dict[str, Any]:
    big = torch.arange(NUMEL, dtype=torch.float32)
    swapped = np.arange(NUMEL, dtype=">f4")
    cases: dict[str, Any] = {
        "non-contiguous": torch.arange(2 * NUMEL, dtype=torch.float32)[::2],
        "0-d": torch.tensor(3.5),
        "small": torch.arange(16, dtype=torch.float32),
        "view": big[10:],
        "transposed": torch.arange(NUMEL, dtype=torch.float32).reshape(128, 128).t(),
        "byte-swapped": swapped,
        "structured": np.zeros(NUMEL, dtype=[("a", "<i4"), ("b", "<f8")]),
        "metadata": np.zeros(NUMEL, dtype=np.dtype(np.float32, metadata={"unit": "m"})),
        "datetime": np.arange(NUMEL).astype("datetime64[s]"),
        "tuple": (big.clone(), big.clone()),
        "requires-grad": torch.zeros(NUMEL, requires_grad=True),
    }
    if hasattr(torch, "float8_e4m3fn"):
        cases["float8"] = torch.zeros(NUMEL, dtype=torch.float8_e4m3fn)
    return cases


@pytest.mark.parametrize("name", list(_cases()))
def test_anything_else_takes_the_pickled_path_unchanged(link: Any, name: str) -> None:
    """Views, 0-d, small, non-contiguous, byte-swapped, structured, datetime and
    float8 outputs, containers and autograd tensors are pickled, and arrive
    exactly as before; so does a chunk mixing them with plain outputs."""
    odd = _cases()[name]
    plain_one = torch.arange(NUMEL, dtype=torch.float64)
    for outputs in ([odd], [plain_one.clone(), odd]):
        expected = describe(transport.copy(outputs))
        got, was_plain = _cross(link, outputs)
        assert not was_plain
        assert describe(got) == expected


def test_describe_refuses_what_it_cannot_state() -> None:
    """``describe`` gives ``None`` (pickle it) for an empty list, a tuple, or
    any element that is not a ring reference."""
    assert plain.describe([]) is None
    assert plain.describe(()) is None
    assert plain.describe([torch.zeros(NUMEL)]) is None


@pytest.mark.parametrize(
    "damage",
    ["dtype-code", "kind", "shape", "ndim", "truncated"],
)
def test_a_damaged_table_is_refused_like_a_dead_worker(link: Any, damage: str) -> None:
    """A table naming an unknown dtype or kind, a shape that does not match
    its bytes, or cut short: ``EOFError`` (the worker is then replaced),
    never a wrong tensor."""
    ring, writer, worker_end, main_end = link
    kept = [ringwriter.stash(torch.zeros(NUMEL), writer) for _ in range(2)]
    message = transport.dumps_plain(struct.pack("<qqqd", 1, 0, 0, 0.0), kept)
    assert message is not None
    head = bytearray(message.head)
    table_at = len(head) - 8 * 10  # two outputs: kind, code, writeable, ndim, dim each
    if damage == "dtype-code":
        struct.pack_into("<q", head, table_at + 8, 999)
    elif damage == "kind":
        struct.pack_into("<q", head, table_at, 5)
    elif damage == "shape":
        struct.pack_into("<q", head, table_at + 32, NUMEL + 1)
    elif damage == "ndim":
        struct.pack_into("<q", head, table_at + 24, 2)
    else:
        head = head[:-8]
    transport.write(worker_end, transport.Message(bytes(head), message.buffers), writer)
    with pytest.raises(EOFError):
        protocol.recv_counted(main_end, ring)


def test_freed_results_give_their_space_back_in_batches(link: Any) -> None:
    """A freed lent buffer's space is written back to the worker once
    ``release_batch`` bytes are freed, or at the next flush; not per result."""
    ring, writer, _, _ = link
    block = 64 * 1024
    per_batch = ring.release_batch // block
    assert per_batch > 2
    placed = [writer.place(memoryview(bytes([k]) * block)) for k in range(per_batch + 2)]
    lent = ring.take_many([(off, block) for off in placed])
    used = writer.used
    for _ in range(per_batch - 1):
        del lent[0]
    writer._drain()
    assert writer.used == used, "released before a batch was full"
    del lent[0]  # the batch is full: written at once
    writer._drain()
    assert writer.used == used - per_batch * ringreader.aligned(block)
    del lent[0]
    writer._drain()
    assert writer.used == used - per_batch * ringreader.aligned(block)
    ring.flush()  # the supervisor's flush writes the rest
    writer._drain()
    assert writer.used == used - (per_batch + 1) * ringreader.aligned(block)
    assert bytes(lent[0][:4]) == bytes([per_batch + 1]) * 4


# -- through a Loader -----------------------------------------------------------------


def plain_output(x: int) -> Any:
    """Each kind of plain output in turn: tensors and arrays of several dtypes and shapes."""
    k = x % 4
    if k == 0:
        return torch.full((NUMEL,), float(x))
    if k == 1:
        return torch.full((64, 256), x, dtype=torch.int16)
    if k == 2:
        return np.full((32, 1024), x, dtype=np.float64)
    a = np.full(NUMEL, x % 2 == 0, dtype=np.bool_)
    a.flags.writeable = False
    return a


def kill_mid_chunk(x: int, *, at: frozenset[int], marker_dir: str) -> Any:
    """:func:`plain_output`; the first worker to reach an item of ``at`` dies
    by SIGKILL, with the chunk's earlier outputs already in its ring."""
    if x in at and _first_time(os.path.join(marker_dir, f"m{x}")):
        os.kill(os.getpid(), signal.SIGKILL)
    return plain_output(x)


def test_plain_results_equal_inline_ones() -> None:
    """Through 2 workers the plain outputs equal those of ``num_workers=0``:
    values, dtypes, shapes, strides, writability."""
    pipe = cp.Pipeline.from_iterable(range(40)).dispatch().map(plain_output)
    got = {}
    for n in (0, 2):
        workers = cp.WorkerConfig(num_workers=n, start_method="fork", chunk_size=4)
        with cp.Loader(pipe, cp.LoaderConfig(workers=workers)) as loader:
            got[n] = [describe(x) for x in loader]
    assert got[2] == got[0]


def test_worker_killed_mid_chunk_on_the_plain_path(tmp_path: Path) -> None:
    """Workers SIGKILLed in the middle of chunks whose earlier outputs are
    already in their rings: every output is exact, in order, none lost or
    doubled, and the rings stay one per worker."""
    fn = functools.partial(kill_mid_chunk, at=frozenset({5, 22, 31}), marker_dir=str(tmp_path))
    pipe = cp.Pipeline.from_iterable(range(48)).dispatch().map(fn)
    workers = cp.WorkerConfig(num_workers=2, start_method="fork", chunk_size=8, max_restarts=5)
    with cp.Loader(pipe, cp.LoaderConfig(workers=workers)) as loader:
        out = list(loader)
        restarts = loader.metrics()["dispatch"]["restarts"]
        moved = loader.metrics()["dispatch"]["transport"]
    assert restarts == 3
    assert moved["shared_memory_bytes"] > 0
    assert [describe(x) for x in out] == [describe(plain_output(i)) for i in range(48)]
