"""Bulk pulls: a boundary takes items from a source or a parallel stage a slice
at a time (``pull_into``), and chunks keep their size once the buffer is full.
Outputs, checkpoints and failures must be those of one-at-a-time pulls."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, cast

import pytest

import centralpipe as cp
from centralpipe.dispatch import sender
from centralpipe.dispatch.reorder import Stamper, Stream, StreamStats
from centralpipe.dispatch.worker.chain import WorkerChain
from centralpipe.stages import IterableSource, RunContext
from centralpipe.testing import assert_resumes_exactly
from tests.fns import faulty

N = 50
CONFIGS = [
    pytest.param(w, ex, id=f"{w}w-{ex}")
    for w, ex in [*((w, "process") for w in range(4)), *((w, "thread") for w in (2, 3))]
]


def _cfg(workers: int = 2, executor: str = "process", **kw: Any) -> cp.LoaderConfig:
    kw.setdefault("buffer_size", 12)
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=workers, executor=executor, start_method="fork", **kw),
        seed=3,
    )


def _square(x: int) -> int:
    return x * x


def _inc(x: int) -> int:
    return x + 1


def _numbers() -> Iterator[int]:
    return iter(range(N))


def _segment_tip(n: int = N) -> cp.Pipeline:
    """The last stage is a parallel map: the loader pulls it in bulk."""
    return cp.Pipeline.from_iterable(range(n)).map(_square, parallel=True, name="sq")


def _dispatch_tip(n: int = N) -> cp.Pipeline:
    """dispatch() right after a parallel map: the feeder pulls it in bulk."""
    return (
        cp.Pipeline.from_iterable(range(n))
        .map(_square, parallel=True, name="sq")
        .dispatch()
        .map(_inc)
    )


def _iterator_source() -> cp.Pipeline:
    """A one-shot iterator factory: the source is sliced, not indexed."""
    return cp.Pipeline.from_iterable(_numbers).map(_square, parallel=True, name="sq")


BUILDS = [
    pytest.param(_segment_tip, [x * x for x in range(N)], id="segment-tip"),
    pytest.param(_dispatch_tip, [x * x + 1 for x in range(N)], id="dispatch-tip"),
    pytest.param(_iterator_source, [x * x for x in range(N)], id="iterator"),
]


@pytest.mark.parametrize(("workers", "executor"), CONFIGS)
@pytest.mark.parametrize(("build", "expected"), BUILDS)
def test_bulk_pulled_pipelines_give_the_inline_output(
    build: Any, expected: list[int], workers: int, executor: str
) -> None:
    """Sources and parallel stages pulled in bulk: the items of a plain loop, two epochs."""
    with cp.Loader(build(), _cfg(workers, executor, chunk_size=4)) as loader:
        assert [list(loader), list(loader)] == [expected, expected]


@pytest.mark.parametrize(
    ("before", "after"),
    [((0, "process"), (2, "process")), ((2, "process"), (3, "thread"))],
    ids=["0to2", "2to3thread"],
)
@pytest.mark.parametrize("build", [_segment_tip, _dispatch_tip], ids=["segment", "dispatch"])
def test_bulk_pulled_pipelines_resume_exactly_at_every_k(
    build: Any, before: tuple[int, str], after: tuple[int, str]
) -> None:
    """A checkpoint between bulk-pulled items resumes exactly, across workers and executors."""
    assert_resumes_exactly(
        build(20), _cfg(*before, chunk_size=3), resume_config=_cfg(*after), epochs=2
    )


@pytest.mark.parametrize(("workers", "executor"), [(0, "process"), (2, "process"), (2, "thread")])
def test_failure_in_a_bulk_pulled_parallel_stage(workers: int, executor: str) -> None:
    """A chunk with a failure is delivered one output at a time: the items before
    it, then WorkerError; with on_error='skip' only that item is missing."""
    fn = functools.partial(faulty.raise_at, at=frozenset({17}))
    pipe = cp.Pipeline.from_iterable(range(N)).map(fn, parallel=True, name="work")
    out: list[int] = []
    with (
        cp.Loader(pipe, _cfg(workers, executor, chunk_size=5)) as loader,
        pytest.raises(cp.WorkerError) as info,
    ):
        for x in loader:
            out.append(x)
    assert out == list(range(17))
    assert (info.value.stage, info.value.seq) == ("work", 17)
    skip = _cfg(workers, executor, chunk_size=5, on_error="skip")
    with cp.Loader(pipe, skip) as loader:
        assert list(loader) == [x for x in range(N) if x != 17]


class _BrokenAt:
    """A map-style dataset whose item ``at`` cannot be read."""

    def __init__(self, n: int, at: int) -> None:
        self.n, self.at = n, at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.at:
            raise faulty.BadValue(f"item {i} is unreadable")
        return i


@pytest.mark.parametrize("counted", [False, True], ids=["bulk", "one-by-one"])
@pytest.mark.parametrize("workers", [0, 2])
def test_source_failing_in_a_bulk_pull(counted: bool, workers: int) -> None:
    """A source failing at item 23: items before it delivered, then its error naming
    the stage; the checkpoint resumes at that item, as with one-at-a-time pulls."""

    def pipe(seq: Any) -> cp.Pipeline:
        p = cp.Pipeline.from_dataset(seq, name="src")
        p = p.count("c") if counted else p  # a stamped tip is pulled one at a time
        return p.map(_square, parallel=True, name="sq")

    out: list[int] = []
    with cp.Loader(pipe(_BrokenAt(N, 23)), _cfg(workers, chunk_size=8)) as loader:
        with pytest.raises(faulty.BadValue, match="unreadable") as info:
            for x in loader:
                out.append(x)
        sd = loader.state_dict()
    assert out == [x * x for x in range(23)]
    assert "central stage 'src'" in "".join(info.value.__notes__)
    with cp.Loader(pipe(_BrokenAt(N, -1)), _cfg(workers)) as loader:
        loader.load_state_dict(sd)
        assert list(loader) == [x * x for x in range(23, N)]


def _source(items: Any) -> IterableSource:
    node = IterableSource(items, "sequence", name="src", ctx=RunContext())
    node.reset(None)
    return node


def test_pull_into_appends_up_to_n_and_counts_them() -> None:
    """pull_into: up to n items in order, fewer at the end, then StopIteration;
    the stage's position and item count follow exactly."""
    node = _source(list(range(10)))
    out: list[int] = []
    node.pull_into(out, 4)
    node.pull_into(out, 4)
    assert out == list(range(8)) and node.own_state() == {"index": 8}
    node.pull_into(out, 4)
    assert out == list(range(10)) and node.items_out == 10
    with pytest.raises(StopIteration):
        node.pull_into(out, 4)
    assert out == list(range(10)) and node.own_state() == {"index": 10}


def test_pull_into_keeps_the_items_before_a_failure() -> None:
    """Items read before a failing one stay in the caller's list; the position is
    at the failing item, which is read again next time."""
    node = _source(_BrokenAt(10, 6))
    out: list[int] = []
    with pytest.raises(faulty.BadValue) as info:
        node.pull_into(out, 8)
    assert out == list(range(6)) and node.own_state() == {"index": 6}
    assert "central stage 'src'" in "".join(info.value.__notes__)


def _stream(buffer_size: int, parallelism: int = 2) -> Stream:
    return Stream(
        tip=_source(list(range(1000))),
        stamper=Stamper([]),
        chain=WorkerChain([], 0),
        epoch=0,
        next_seq=0,
        resume=None,
        delivered_stamp=None,
        buffer_size=buffer_size,
        chunk_size=None,
        on_error="raise",
        stats=StreamStats(parallelism),
        dispatch_name="dispatch",
        parallelism=parallelism,
    )


def test_a_chunk_is_pulled_only_when_a_whole_one_fits() -> None:
    """Once the buffer is full, retiring a small chunk does not start a small one:
    the next chunk waits for room for its whole size (else chunks stay small)."""
    s = _stream(buffer_size=64)
    s.cost_per_item = 1e-6  # cheap items: the target is 64 // (2 * 2) = 16
    assert sender.target_chunk(s) == 16
    s.in_flight = 49
    assert not sender.has_room(s)
    s.in_flight = 48
    assert sender.has_room(s)
    chunk = sender.pull_chunk(s)
    assert chunk is not None and chunk.items == list(range(16))
    assert s.in_flight == 64 and not sender.has_room(s)


def test_pull_chunk_takes_a_source_in_bulk_in_order() -> None:
    """Chunks pulled in bulk from a source are consecutive, numbered from 0, and
    the source's position is the end of the last chunk."""
    s = _stream(buffer_size=4096, parallelism=1)
    chunks = [sender.pull_chunk(s) for _ in range(3)]
    items = [x for c in chunks if c is not None for x in c.items]
    assert items == list(range(len(items))) and len(items) == 3 * sender.FIRST_CHUNK
    assert [c.first_seq for c in chunks if c is not None] == [0, 16, 32]
    assert s.tip.own_state() == {"index": 48} and s.next_seq == 48


def test_a_range_chunk_aims_at_more_work_within_the_same_bounds() -> None:
    """A chunk of lines read in the worker (a range) aims at
    ``TARGET_RANGE_CHUNK_S`` of work instead of ``TARGET_CHUNK_S``: its
    main-process cost is per chunk. The result-byte and buffer limits bound
    it as they bound any chunk."""
    from centralpipe.dispatch import pull, timeouts

    s = _stream(buffer_size=1_000_000)
    s.cost_per_item = 50e-6
    lines = int(timeouts.TARGET_CHUNK_S / 50e-6)
    assert sender.target_chunk(s) == lines
    s.ranges = cast(Any, object())  # the stream reads its lines as ranges
    assert sender.target_chunk(s) == int(timeouts.TARGET_RANGE_CHUNK_S / 50e-6) > lines
    s.stats.bytes_per_item = pull.MAX_CHUNK_RESULT_BYTES / 100
    assert sender.target_chunk(s) == 100
    s.stats.bytes_per_item = -1.0
    s.buffer_size = 400
    assert sender.target_chunk(s) == 400 // (2 * 2)
