"""When an item fails, every item before it is delivered first, whatever the
failure (a stage raising, an exception that cannot be printed, a result or an
item that cannot be unpickled on the other side, a worker killed or hung by
the item) and whatever the chunk size; ``on_error="skip"`` skips just it."""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest

import centralpipe as cp
from tests.fns import faulty

N = 40
BAD = 13
CHUNKS = [pytest.param(1, id="chunk1"), pytest.param(8, id="chunk8")]


class _RebuildFails:
    """Pickles anywhere; unpickling raises in every process but ``pid``'s
    (``pid=None``: in every process)."""

    def __init__(self, value: int, pid: int | None) -> None:
        self.value = value
        self.pid = pid

    def __reduce__(self) -> Any:
        return (_rebuild, (self.value, self.pid))


def _rebuild(value: int, pid: int | None) -> _RebuildFails:
    if pid is None or os.getpid() != pid:
        raise ValueError(f"item {value} cannot be rebuilt in process {os.getpid()}")
    return _RebuildFails(value, pid)


def _result_fails_in_main(x: int, *, main_pid: int) -> Any:
    """Item BAD becomes an object that unpickles only in a worker."""
    return _RebuildFails(x, None) if x == BAD else x


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


def _raise_unprintable(x: int) -> int:
    if x == BAD:
        raise _Unprintable()
    return x


def _value(x: Any) -> Any:
    return x.value if isinstance(x, _RebuildFails) else x


def _drain(loader: cp.Loader[Any]) -> tuple[list[Any], BaseException | None]:
    out: list[Any] = []
    try:
        for x in loader:
            out.append(x)
    except cp.WorkerError as exc:
        return out, exc
    return out, None


def _config(workers: int, chunk: int, **kw: Any) -> cp.LoaderConfig:
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(
            num_workers=workers, start_method="fork", chunk_size=chunk, buffer_size=64, **kw
        )
    )


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_result_that_cannot_be_unpickled_in_main(chunk: int, on_error: str) -> None:
    """A result that pickles in the worker but not back: WorkerError at the last
    stage and its seq after every earlier item, or skipped."""
    fn = functools.partial(_result_fails_in_main, main_pid=os.getpid())
    pipe = cp.Pipeline.from_iterable(range(N)).dispatch().map(fn, name="make")
    with cp.Loader(pipe, _config(2, chunk, on_error=on_error)) as loader:
        out, err = _drain(loader)
        if on_error == "skip":
            assert err is None
            assert out == [x for x in range(N) if x != BAD]
            assert loader.metrics()["dispatch"]["skipped"] == 1
            return
    assert out == list(range(BAD))
    assert isinstance(err, cp.WorkerError)
    assert (err.stage, err.seq, err.exc_type) == ("make", BAD, "ValueError")
    assert "cannot be unpickled in the main process" in str(err)


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "2-workers"])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_item_that_cannot_be_unpickled_for_the_worker_stages(workers: int, chunk: int) -> None:
    """A central item that cannot be unpickled again fails at the boundary stage,
    by seq, after every earlier item; the same for 0 and 2 workers."""
    items = [_RebuildFails(x, None) if x == BAD else x for x in range(N)]
    pipe = cp.Pipeline.from_iterable(items).dispatch(name="hand_over").map(_value)
    with cp.Loader(pipe, _config(workers, chunk)) as loader:
        out, err = _drain(loader)
    assert out == list(range(BAD))
    assert isinstance(err, cp.WorkerError)
    assert (err.stage, err.seq) == ("hand_over", BAD)


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "2-workers"])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_exception_whose_str_raises(workers: int, chunk: int) -> None:
    """An exception whose __str__ raises is a WorkerError naming stage, seq and
    type, after every earlier item; no worker dies."""
    pipe = cp.Pipeline.from_iterable(range(N)).dispatch().map(_raise_unprintable, name="boom")
    with cp.Loader(pipe, _config(workers, chunk)) as loader:
        out, err = _drain(loader)
        assert loader.metrics()["dispatch"]["restarts"] == 0
    assert out == list(range(BAD))
    assert isinstance(err, cp.WorkerError)
    assert (err.stage, err.seq, err.exc_type) == ("boom", BAD, "_Unprintable")


@pytest.mark.parametrize("chunk", CHUNKS)
def test_poison_item_is_raised_after_earlier_items(chunk: int) -> None:
    """An item that kills every worker is raised in its place: every earlier
    item is delivered first, with the exit code."""
    fn = functools.partial(faulty.segfault_always, at=BAD)
    pipe = cp.Pipeline.from_iterable(range(N)).dispatch().map(fn, name="crash")
    with cp.Loader(pipe, _config(2, chunk)) as loader:
        out, err = _drain(loader)
    assert out == list(range(BAD))
    assert isinstance(err, cp.WorkerError)
    assert (err.stage, err.seq) == ("crash", BAD)
    assert err.exitcode is not None and err.exitcode < 0


def test_hung_item_is_raised_after_earlier_items() -> None:
    """An item that hangs every worker past timeout_s is raised in its place."""
    fn = functools.partial(faulty.hang_always, at=BAD)
    pipe = cp.Pipeline.from_iterable(range(N)).dispatch().map(fn, name="stuck")
    with cp.Loader(pipe, _config(2, 8, timeout_s=0.5, item_retries=0)) as loader:
        out, err = _drain(loader)
    assert out == list(range(BAD))
    assert isinstance(err, cp.WorkerError)
    assert (err.stage, err.seq) == ("stuck", BAD)
    assert "hung" in str(err)
