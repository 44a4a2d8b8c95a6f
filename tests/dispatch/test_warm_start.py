"""Inline warm start (``dispatch.warm``, opt-in: ``start_inline=True``): while
a forkserver or spawn pool is still starting, the main process runs the first
chunks through the workers' serialisation and hands over to the workers once
they are ready.

The pool's start is held back by a gate (a test-only patch of
``ProcessPool.start``, which the background start runs) so each test decides
when the workers become ready: output, errors, skipped counts and
checkpoints are those of ``num_workers=0``, interrupts lose nothing, close()
ends everything, a failed start is raised, and the off switches hold.
"""

from __future__ import annotations

import errno
import functools
import gc
import operator
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.dispatch.executors.procpool import ProcessPool
from centralpipe.dispatch.worker.chain import WorkerChain
from centralpipe.errors import ConfigError, WorkerError
from centralpipe.testing import collect
from tests.dispatch.test_dispatch_interrupts import _interrupted_next_goes_on, _once_at, _sweep

N = 200
#: Bound on waiting for the workers once the gate is open (a loaded machine).
READY_WAIT_S = 60.0


def _noisy(x: int, rng: Any) -> tuple[int, float]:
    """Uses its seeded generator: the same whoever runs it."""
    import torch

    return x, float(torch.rand((), generator=rng))


def _fails_on_7s(x: int) -> int:
    if x % 50 == 7:
        raise ValueError(f"bad item {x}")
    return 3 * x


#: ``3 * x`` from the standard library: a worker imports no test module for
#: it, so it is ready soon after the gate opens.
_times3 = functools.partial(operator.mul, 3)


class _Counter:
    """A stateful worker-stage callable."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, x: int) -> int:
        self.n += 1
        return x

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.n = sd["n"]


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The pool's start waits until the returned event is set (or the start
    is cancelled); set at the end of the test."""
    opened = threading.Event()
    real = ProcessPool.start

    def held_start(self: ProcessPool, stop: Callable[[], bool] | None = None) -> None:
        while not opened.wait(0.01):
            if stop is not None and stop():
                return
        real(self, stop)

    monkeypatch.setattr(ProcessPool, "start", held_start)
    yield opened
    opened.set()


def _pipe(fn: Callable[..., Any] = _times3, **options: Any) -> cp.Pipeline:
    return cp.Pipeline.from_iterable(range(N)).count("c").dispatch().map(fn, **options)


def _config(
    num_workers: int = 2, method: str = "forkserver", *, inline: bool | None = True, **workers: Any
) -> cp.LoaderConfig:
    """``inline``: ``start_inline`` (opted in unless told otherwise; ``None``: the default)."""
    options: dict[str, Any] = {"buffer_size": 64, "chunk_size": 8, **workers}
    if inline is not None:
        options["start_inline"] = inline
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=num_workers, start_method=method, **options),
        seed=5,
    )


def _open_and_wait(gate: threading.Event, loader: cp.Loader[Any]) -> None:
    """Let the pool start; wait until every worker is ready."""
    gate.set()
    starter = loader._central._res.starter
    deadline = time.monotonic() + READY_WAIT_S
    while starter is not None and not starter.workers_ready():
        assert time.monotonic() < deadline, "the workers never became ready"
        time.sleep(0.01)


def _split_run(
    gate: threading.Event, loader: cp.Loader[Any], k: int
) -> tuple[list[Any], Iterator[Any]]:
    """``k`` items while the workers are held back, then the gate opened."""
    it = iter(loader)
    got = [next(it) for _ in range(k)]
    assert loader.worker_pids() == [], "no worker was ready yet"
    assert loader.metrics()["dispatch"]["inline_items"] >= k
    _open_and_wait(gate, loader)
    return got, it


def _handed_over(loader: cp.Loader[Any]) -> None:
    m = loader.metrics()["dispatch"]
    assert sum(m["items_per_worker"]) > 0, "the workers took over"
    assert m["inline_items"] + sum(m["items_per_worker"]) == m["dispatched"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_output_is_that_of_num_workers_0(gate: threading.Event, method: str) -> None:
    """Seeded items run inline while the pool starts, then by the workers:
    the output (values, order, random streams) equals num_workers=0's, and
    the next epoch runs on the workers alone. (spawn: a standard-library
    function, so each spawned worker boots without importing torch.)"""
    pipe = _pipe(_noisy, with_rng=True) if method == "forkserver" else _pipe()
    with cp.Loader(pipe, _config(0)) as inline:
        expected = [collect(inline), collect(inline)]
    with cp.Loader(pipe, _config(2, method)) as loader:
        got, it = _split_run(gate, loader, 30)
        got += list(it)
        assert got == expected[0]
        _handed_over(loader)
        assert loader.query("c", delivered=True)["items"] == N
        inline_items = loader.metrics()["dispatch"]["inline_items"]
        assert collect(loader) == expected[1]
        assert loader.metrics()["dispatch"]["inline_items"] == inline_items
        assert len(loader.worker_pids()) == 2


def _fails_at_150(x: int) -> int:
    if x == 150:
        raise ValueError(f"bad item {x}")
    return 3 * x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["inline", "worker"])
def test_on_error_raise_is_the_same(gate: threading.Event, where: str) -> None:
    """A failing item raises the same WorkerError after the same items,
    whether the main process ran it (the pool still starting) or a worker."""
    pipe = _pipe(_fails_at_150)
    with cp.Loader(pipe, _config(0)) as inline:
        before: list[int] = []
        with pytest.raises(WorkerError) as ref:
            for x in inline:
                before.append(x)
    with cp.Loader(pipe, _config(2)) as loader:
        it = iter(loader)
        got = [next(it) for _ in range(3)]
        if where == "worker":
            _open_and_wait(gate, loader)
        with pytest.raises(WorkerError) as info:
            while True:
                got.append(next(it))
        assert got == before
        assert (
            (info.value.seq, info.value.stage) == (ref.value.seq, ref.value.stage) == (150, "map_3")
        )
        ran = sum(loader.metrics()["dispatch"]["items_per_worker"])
        assert (ran > 0) == (where == "worker")


#: The item that cannot cross the boundary, in the second chunk of 8.
BAD = 13


class _NotRebuilt:
    """Pickles, but unpickling it raises (in any process)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> Any:
        return (_rebuild, (self.value,))


def _rebuild(value: int) -> _NotRebuilt:
    raise ValueError(f"object {value} cannot be rebuilt")


def _result_not_rebuilt(x: int) -> Any:
    return _NotRebuilt(x) if x == BAD else 3 * x


def _result_not_pickled(x: int) -> Any:
    return threading.Lock() if x == BAD else 3 * x


def _times3_of_value(x: Any) -> int:
    return 3 * (x.value if isinstance(x, _NotRebuilt) else x)


#: What cannot cross the boundary: (the source's items, the worker stage).
CANNOT_CROSS: dict[str, tuple[list[Any], Callable[[Any], Any]]] = {
    "result-not-rebuilt": (list(range(N)), _result_not_rebuilt),
    "result-not-pickled": (list(range(N)), _result_not_pickled),
    "item-not-rebuilt": ([_NotRebuilt(x) if x == BAD else x for x in range(N)], _times3_of_value),
}


def _outcome(loader: cp.Loader[Any]) -> tuple[list[Any], tuple[Any, ...] | None, int]:
    """The output, the WorkerError (type, stage, seq, exc_type, text) if
    one ended the pass, and the skipped count."""
    out: list[Any] = []
    error = None
    try:
        for x in loader:
            out.append(x)
    except WorkerError as exc:
        error = (type(exc), exc.stage, exc.seq, exc.exc_type, str(exc), exc.remote_traceback)
    return out, error, loader.metrics()["dispatch"]["skipped"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("case", CANNOT_CROSS)
def test_what_cannot_cross_fails_inline_as_with_workers(
    gate: threading.Event, case: str, on_error: str
) -> None:
    """An item or a result that cannot cross the boundary (not rebuilt on the
    other side, not picklable) fails in the chunks the main process runs
    exactly as with workers: the same output before it, the same
    WorkerError (stage, seq, type, text) or the same skipped count."""
    items, fn = CANNOT_CROSS[case]
    pipe = cp.Pipeline.from_iterable(items).dispatch(name="hand").map(fn, name="stage")
    gate.set()
    with cp.Loader(pipe, _config(2, "fork", on_error=on_error)) as workers:
        expected = _outcome(workers)
        assert sum(workers.metrics()["dispatch"]["items_per_worker"]) > 0
    gate.clear()
    out, error, skipped = expected
    assert (error is None) == (on_error == "skip")
    assert out == [3 * x for x in range(BAD if error else N) if x != BAD]
    assert skipped == (1 if on_error == "skip" else 0)
    with cp.Loader(pipe, _config(2, on_error=on_error)) as loader:  # the pool held back
        assert _outcome(loader) == expected
        m = loader.metrics()["dispatch"]
        assert m["inline_items"] >= BAD and sum(m["items_per_worker"]) == 0


@pytest.mark.timeout(60)
def test_a_parallel_stage_result_that_cannot_cross_fails_inline_as_with_workers(
    gate: threading.Event,
) -> None:
    """A parallel central stage's result that cannot be rebuilt in the main
    process is the same WorkerError after the same items whether a worker
    ran it or the main process while the pool starts."""
    pipe = (
        cp.Pipeline.from_iterable(range(N))
        .map(_result_not_rebuilt, parallel=True, name="par")
        .dispatch()
    )
    gate.set()
    with cp.Loader(pipe, _config(2, "fork")) as workers:
        expected = _outcome(workers)
    gate.clear()
    out, error, _ = expected
    assert out == [3 * x for x in range(BAD)]
    assert error is not None and error[1:3] == ("par", BAD)
    with cp.Loader(pipe, _config(2)) as loader:  # the pool held back
        assert _outcome(loader) == expected
        assert sum(loader.metrics()["par"]["parallel"]["items_per_worker"]) == 0


@pytest.mark.timeout(60)
def test_on_error_skip_is_the_same(gate: threading.Event) -> None:
    """Skipped items and the skipped count are those of num_workers=0, with
    failures both inline and in the workers."""
    pipe = _pipe(_fails_on_7s)
    with cp.Loader(pipe, _config(0, on_error="skip")) as inline:
        expected = collect(inline)
        skipped = inline.metrics()["dispatch"]["skipped"]
    assert skipped == 4
    with cp.Loader(pipe, _config(2, on_error="skip")) as loader:
        got, it = _split_run(gate, loader, 60)
        got += list(it)
        assert got == expected
        assert loader.metrics()["dispatch"]["skipped"] == skipped
        _handed_over(loader)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("resume_workers", [0, 2])
def test_checkpoint_taken_inline_resumes_exactly(
    gate: threading.Event, resume_workers: int
) -> None:
    """A checkpoint taken while the main process runs the chunks resumes
    exactly in a fresh loader (any num_workers); the pass itself goes on."""
    pipe = _pipe()
    expected = [3 * i for i in range(N)]
    with cp.Loader(pipe, _config(2)) as loader:
        it = iter(loader)
        got = [next(it) for _ in range(37)]
        sd = loader.state_dict()
        assert sd["in_flight"]["dispatch"]["items"], "taken mid-chunk"
        _open_and_wait(gate, loader)
        assert got + list(it) == expected
    gate.set()
    with cp.Loader(pipe, _config(resume_workers, "fork")) as fresh:
        fresh.load_state_dict(sd)
        assert got + collect(fresh) == expected
        assert fresh.query("c", delivered=True)["items"] == N


@pytest.mark.timeout(60)
@pytest.mark.parametrize("after", [True, False], ids=["worker-stage-after", "no-worker-stage"])
def test_parallel_stage_runs_inline_then_on_the_workers(gate: threading.Event, after: bool) -> None:
    """A parallel central stage runs inline too while the pool starts, then
    on the workers (with or without worker stages after the boundary):
    output equals num_workers=0's."""
    pipe = cp.Pipeline.from_iterable(range(N)).map(_times3, parallel=True).count("c").dispatch()
    if after:
        pipe = pipe.map(_times3)
    expected = [(9 if after else 3) * i for i in range(N)]
    with cp.Loader(pipe, _config(2)) as loader:
        it = iter(loader)
        got = [next(it) for _ in range(40)]
        assert loader.worker_pids() == []
        _open_and_wait(gate, loader)
        assert got + list(it) == expected
        assert sum(loader.metrics()["map_1"]["parallel"]["items_per_worker"]) > 0
        assert loader.query("c", delivered=True)["items"] == N


@pytest.mark.timeout(60)
def test_a_checkpoint_resumes_in_a_loader_that_is_warming_up(gate: threading.Event) -> None:
    """A checkpoint loaded into a fresh loader whose workers are still
    starting resumes exactly: the in-flight items run inline first, then the
    workers take over."""
    pipe = _pipe()
    expected = [3 * i for i in range(N)]
    gate.set()
    with cp.Loader(pipe, _config(2, "fork")) as first:
        it = iter(first)
        got = [next(it) for _ in range(45)]
        sd = first.state_dict()
    gate.clear()
    with cp.Loader(pipe, _config(2)) as fresh:
        fresh.load_state_dict(sd)
        it = iter(fresh)
        got += [next(it) for _ in range(20)]
        assert fresh.metrics()["dispatch"]["inline_items"] >= 20
        _open_and_wait(gate, fresh)
        assert got + list(it) == expected
        _handed_over(fresh)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_ctrl_c_in_an_inline_chunk_loses_nothing(
    gate: threading.Event, monkeypatch: pytest.MonkeyPatch, after: bool
) -> None:
    """Ctrl-C while the main process runs a chunk for the starting pool: raised
    at once; the same iterator goes on exactly (the chunk is run again
    inline before the hand-over), and the checkpoint taken then resumes."""
    pipe = _pipe()
    expected = [3 * i for i in range(N)]
    with cp.Loader(pipe, _config(2)) as loader:
        it = iter(loader)
        got = [next(it) for _ in range(10)]
        monkeypatch.setattr(WorkerChain, "run_chunk", _once_at(WorkerChain.run_chunk, 1, after))
        with pytest.raises(KeyboardInterrupt):
            while True:
                got.append(next(it))
        monkeypatch.setattr(WorkerChain, "run_chunk", WorkerChain.__dict__["run_chunk"])
        sd = loader.state_dict()
        _open_and_wait(gate, loader)
        assert got + list(it) == expected
        _handed_over(loader)
    with cp.Loader(pipe, _config(0)) as fresh:
        fresh.load_state_dict(sd)
        assert got + collect(fresh) == expected


@pytest.mark.timeout(240)
def test_ctrl_c_anywhere_in_the_hand_over(gate: threading.Event) -> None:
    """An interrupt at every function entry of the next() that hands over to
    the ready workers: raised at once, the same iterator then delivers
    exactly the rest, and the checkpoint taken then resumes exactly."""
    pipe = _pipe()
    expected = [3 * i for i in range(N)]
    config = _config(1)

    def attempt(k: int) -> bool:
        gate.clear()
        with cp.Loader(pipe, config) as loader:
            it = iter(loader)
            got = [next(it) for _ in range(8)]  # one whole inline chunk
            _open_and_wait(gate, loader)
            landed, sd, at = _interrupted_next_goes_on(k, loader, it, got, expected)
            _handed_over(loader)
        with cp.Loader(pipe, _config(0)) as fresh:
            fresh.load_state_dict(sd)
            assert got[:at] + collect(fresh) == expected, f"interrupt at event {k}"
        return landed

    assert _sweep(attempt) > 10


@pytest.mark.timeout(120)
def test_ctrl_c_anywhere_in_an_inline_next(gate: threading.Event) -> None:
    """An interrupt at every function entry of a next() that runs a chunk
    inline for the starting pool (the readiness check included): raised at
    once, nothing lost or repeated, and the checkpoint taken then resumes."""
    pipe = _pipe()
    expected = [3 * i for i in range(N)]

    def attempt(k: int) -> bool:
        with cp.Loader(pipe, _config(2)) as loader:
            it = iter(loader)
            got = [next(it) for _ in range(8)]  # the first chunk: the next next() pulls
            landed, sd, at = _interrupted_next_goes_on(k, loader, it, got, expected)
            assert loader.metrics()["dispatch"]["items_per_worker"] == [0, 0]
        with cp.Loader(pipe, _config(0)) as fresh:
            fresh.load_state_dict(sd)
            assert got[:at] + collect(fresh) == expected, f"interrupt at event {k}"
        return landed

    assert _sweep(attempt) > 10


@pytest.mark.timeout(60)
def test_close_while_running_inline_ends_everything(gate: threading.Event) -> None:
    """close() while the main process runs items and the pool is still held
    back: the start is cancelled, nothing is left (the leak fixture checks),
    and the iterator says it was superseded."""
    loader = cp.Loader(_pipe(), _config(2))
    it = iter(loader)
    assert [next(it) for _ in range(5)] == [0, 3, 6, 9, 12]
    pool = loader._central._res.starter.pool  # type: ignore[union-attr]
    loader.close()
    assert pool.shut and loader._central._res.starter is None
    with pytest.raises(RuntimeError, match="superseded"):
        for _ in range(N):
            next(it)


@pytest.mark.timeout(60)
def test_garbage_collected_while_running_inline_leaves_nothing(gate: threading.Event) -> None:
    """A Loader dropped (with its iterator) while the main process runs items
    for the starting pool is collected: its finalizer cancels the start and
    nothing is left (the run holds no strong reference to the Loader)."""
    loader = cp.Loader(_pipe(), _config(2))
    it = iter(loader)
    assert [next(it) for _ in range(5)] == [0, 3, 6, 9, 12]
    pool = loader._central._res.starter.pool  # type: ignore[union-attr]
    alive = weakref.ref(loader)
    del it, loader
    gc.collect()
    assert alive() is None
    assert pool.shut


@pytest.mark.timeout(60)
def test_failed_start_while_inline_is_raised_and_the_pass_goes_on(
    gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker start that fails while the main process runs items is raised
    by the next() that would hand over, with a note saying where; the next
    next() starts the workers again and the pass goes on exactly."""
    real = ProcessPool._start
    fails = [1]

    def failing_start(self: ProcessPool, slot: Any) -> None:
        if slot.index == 1 and fails:
            fails.pop()
            raise OSError(errno.EMFILE, "Too many open files")
        real(self, slot)

    monkeypatch.setattr(ProcessPool, "_start", failing_start)
    expected = [3 * i for i in range(N)]
    with cp.Loader(_pipe(), _config(2)) as loader:
        it = iter(loader)
        got = [next(it) for _ in range(20)]
        pool = loader._central._res.starter.pool  # type: ignore[union-attr]
        _open_and_wait(gate, loader)
        with pytest.raises(OSError, match="Too many open files") as info:
            while True:
                got.append(next(it))
        assert any("in the background" in note for note in info.value.__notes__)
        assert pool.shut
        got += list(it)
        assert got == expected
        _handed_over(loader)


NEVER_INLINE = {
    "default": {"inline": None},
    "off": {"inline": False},
    "timeout_s": {"timeout_s": 30.0},
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", [*NEVER_INLINE, "stateful"])
def test_cases_that_wait_for_the_workers(gate: threading.Event, case: str) -> None:
    """The default config, start_inline=False, timeout_s set (a hung item
    could not be stopped inline) and stateful worker stages (their state
    would be split): the first next() waits for the workers, and they run
    every item."""
    if case == "stateful":
        pipe = cp.Pipeline.from_iterable(range(N)).dispatch().map(_Counter())
        config = _config(2)
    else:
        pipe = _pipe()
        config = _config(2, **NEVER_INLINE[case])
    opener = threading.Timer(0.3, gate.set)
    opener.start()
    try:
        with cp.Loader(pipe, config) as loader:
            assert collect(loader) == [x if case == "stateful" else 3 * x for x in range(N)]
            m = loader.metrics()["dispatch"]
            assert m["inline_items"] == 0 and sum(m["items_per_worker"]) == N
    finally:
        opener.join()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("executor", ["fork", "thread"])
def test_fork_and_threads_never_run_inline(executor: str) -> None:
    """fork workers (they start in milliseconds) and thread workers never
    make the main process run items."""
    if executor == "thread":
        config = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=2, executor="thread"))
    else:
        config = _config(2, "fork")
    with cp.Loader(_pipe(), config) as loader:
        assert collect(loader) == [3 * x for x in range(N)]
        assert loader.metrics()["dispatch"]["inline_items"] == 0


@pytest.mark.parametrize("bad", ["yes", 1, 0, None, 1.0])
def test_start_inline_must_be_a_bool(bad: Any) -> None:
    """A start_inline that is not a bool is a ConfigError naming the field."""
    with pytest.raises(ConfigError, match="start_inline"):
        cp.WorkerConfig(start_inline=bad)
    with pytest.raises(ConfigError, match="start_inline"):
        cp.LoaderConfig.from_dict({"workers": {"start_inline": bad}})


def test_start_inline_round_trips(tmp_path: Any) -> None:
    """start_inline is in to_dict/from_dict and read from TOML."""
    config = cp.LoaderConfig(workers=cp.WorkerConfig(start_inline=False))
    assert config.to_dict()["workers"]["start_inline"] is False
    assert cp.LoaderConfig.from_dict(config.to_dict()) == config
    on = cp.LoaderConfig(workers=cp.WorkerConfig(start_inline=True))
    assert cp.LoaderConfig.from_dict(on.to_dict()) == on
    path = tmp_path / "c.toml"
    path.write_text("[workers]\nnum_workers = 2\nstart_inline = true\n")
    assert cp.LoaderConfig.from_toml(path).workers.start_inline is True
