"""``centralpipe.progress``: a tqdm bar over a count stage, exact as delivered."""

from __future__ import annotations

import importlib
import io
import itertools
import types
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from tqdm.std import tqdm

import centralpipe as cp

# ``centralpipe.progress`` is the function; this is its module.
progress_module = importlib.import_module("centralpipe.integrations.progress")

N = 500
BATCH = 7
N_BATCHES = -(-N // BATCH)


class RecordingBar(tqdm):  # type: ignore[misc]
    """A real tqdm bar writing to a string, remembering how it was made."""

    made: list[RecordingBar] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("file", io.StringIO())
        self.output = kwargs["file"]
        self.initial_value = kwargs.get("initial", 0)
        self.closed = False
        super().__init__(*args, **kwargs)
        self.shown = not self.disable
        RecordingBar.made.append(self)

    def close(self) -> None:
        self.closed = True
        super().close()


@pytest.fixture(autouse=True)
def bars(monkeypatch: pytest.MonkeyPatch) -> list[RecordingBar]:
    """Every bar ``progress`` makes in the test, in order."""
    made: list[RecordingBar] = []
    monkeypatch.setattr(RecordingBar, "made", made)
    monkeypatch.setattr(progress_module, "tqdm", RecordingBar)
    return made


def _size(batch: list[int]) -> int:
    return len(batch)


def _fail_on_5(x: int) -> int:
    if x == 5:
        raise RuntimeError("bad item")
    return x


def _pipe(equalize: str | None = None) -> cp.Pipeline:
    """Batches of ``range(N)``; each output is its batch's size (the weight)."""
    return (
        cp.Pipeline.from_iterable(range(N))
        .batch(BATCH)
        .count("pre_shard", weight_fn=len)
        .shard(equalize=equalize)
        .dispatch()
        .map(_size)
    )


def _cfg(
    workers: int = 0, buffer_size: int | None = 8, rank: int = 0, world_size: int = 1
) -> cp.LoaderConfig:
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=workers, buffer_size=buffer_size, start_method="fork"),
        distributed=cp.DistributedConfig(rank=rank, world_size=world_size),
    )


CONFIGS = [
    pytest.param(0, 8, id="inline-buffer8"),
    pytest.param(0, None, id="inline-unlimited"),
    pytest.param(2, 8, id="2workers-buffer8"),
    pytest.param(2, None, id="2workers-unlimited"),
]


@pytest.mark.parametrize(("workers", "buffer_size"), CONFIGS)
def test_bar_ends_at_the_exact_pre_shard_weight(
    bars: list[RecordingBar], workers: int, buffer_size: int | None
) -> None:
    """After a full pass the bar shows the count stage's weight and item count."""
    with cp.Loader(_pipe(), _cfg(workers, buffer_size)) as loader:
        out = list(cp.progress(loader, total=N, unit="seq"))
        assert loader.query("pre_shard", delivered=True) == {"items": N_BATCHES, "weight": N}
    (bar,) = bars
    assert sum(out) == N
    assert (bar.shown, bar.closed, bar.n, bar.total) == (True, True, N, N)
    assert bar.postfix == f"items={N_BATCHES}"


@pytest.mark.parametrize(("workers", "buffer_size"), CONFIGS)
@pytest.mark.parametrize("k", [1, 10, 40])
def test_bar_is_exact_when_the_consumer_stops_early(
    bars: list[RecordingBar], workers: int, buffer_size: int | None, k: int
) -> None:
    """Breaking after k items leaves the bar at the weight of exactly those k
    items, though the feeder ran ahead (no in-loop update: huge interval)."""
    with cp.Loader(_pipe(), _cfg(workers, buffer_size)) as loader:
        head = []
        for size in cp.progress(loader, min_interval_s=3600):
            head.append(size)
            if len(head) == k:
                break
        (bar,) = bars
        assert bar.closed  # the generator was dropped at the break
        assert bar.n == sum(head) == loader.query("pre_shard", delivered=True)["weight"]
        assert bar.postfix == f"items={k}"


def test_bar_value_is_pre_shard_on_rank_0_and_absent_on_other_ranks(
    bars: list[RecordingBar],
) -> None:
    """With two ranks, rank 0's bar counts the whole central stream; rank 1
    iterates its shard without a bar."""
    outputs = []
    for rank in (0, 1):
        with cp.Loader(_pipe("drop_last"), _cfg(2, None, rank, 2)) as loader:
            outputs.append(list(cp.progress(loader, total=N)))
    shown, hidden = bars
    assert (shown.shown, shown.n) == (True, N)
    assert not hidden.shown
    assert hidden.output.getvalue() == ""
    assert len(outputs[0]) == len(outputs[1]) == N_BATCHES // 2
    with cp.Loader(_pipe("drop_last"), _cfg(0, 8, 1, 2)) as loader:
        assert outputs[1] == list(loader)


def test_rank_argument_overrides_the_loader_rank(bars: list[RecordingBar]) -> None:
    """``rank=0`` shows a bar on a rank-1 loader; ``rank=1`` hides it on rank 0."""
    with cp.Loader(_pipe(), _cfg(0, 8, 1, 2)) as loader:
        list(cp.progress(loader, rank=0))
    with cp.Loader(_pipe(), _cfg()) as loader:
        list(cp.progress(loader, rank=1))
    assert [b.shown for b in bars] == [True, False]
    assert bars[0].n == N


class _Clock:
    """A fake ``time`` module whose clock advances ``step_s`` per reading."""

    def __init__(self, step_s: float) -> None:
        self.now = 0.0
        self.step_s = step_s

    def monotonic(self) -> float:
        self.now += self.step_s
        return self.now


@pytest.mark.parametrize("interval_s", [0.0, 0.1, 0.25], ids=str)
def test_query_is_called_at_most_every_min_interval(
    monkeypatch: pytest.MonkeyPatch, interval_s: float
) -> None:
    """The clock is read per item, but the stage is queried only when
    ``min_interval_s`` has passed, plus at the call, the start and the end."""
    clock = _Clock(step_s=0.01)
    monkeypatch.setattr(progress_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    pipe = cp.Pipeline.from_iterable(range(1000)).count("pre_shard").dispatch().map(_size_one)
    with cp.Loader(pipe, _cfg()) as loader:
        calls: list[float] = []
        real_query = loader.query

        def counting_query(name: str, *, delivered: bool = False) -> dict[str, Any]:
            calls.append(clock.now)
            return real_query(name, delivered=delivered)

        monkeypatch.setattr(loader, "query", counting_query)
        assert len(list(cp.progress(loader, min_interval_s=interval_s))) == 1000
    in_loop = calls[2:-1]  # the call's check and the start; the end
    if interval_s == 0:
        assert len(in_loop) == 1000
    else:
        assert len(in_loop) <= 1000 * clock.step_s / interval_s + 1
        gaps = [b - a for a, b in itertools.pairwise(in_loop)]
        assert min(gaps) >= interval_s - 1e-9


def _size_one(x: int) -> int:
    return 1


def test_bad_arguments_raise_at_the_call() -> None:
    """An unknown stage is a KeyError, a non-count stage or a negative interval
    a ValueError, before anything is iterated."""
    with cp.Loader(_pipe(), _cfg()) as loader:
        with pytest.raises(KeyError, match="nope"):
            cp.progress(loader, "nope")
        with pytest.raises(ValueError, match="count stages"):
            cp.progress(loader, "batch_1")
        with pytest.raises(ValueError, match="min_interval_s"):
            cp.progress(loader, min_interval_s=-1)
        assert loader.epoch == 0


def test_bar_is_closed_and_exact_when_a_worker_stage_raises(bars: list[RecordingBar]) -> None:
    """A WorkerError passes through; the bar closes at the last delivered item."""
    pipe = cp.Pipeline.from_iterable(range(20)).count("pre_shard").dispatch().map(_fail_on_5)
    with cp.Loader(pipe, _cfg(2, None)) as loader:
        out = []
        with pytest.raises(cp.WorkerError):
            for x in cp.progress(loader):
                out.append(x)
    (bar,) = bars
    assert out == [0, 1, 2, 3, 4]
    assert bar.closed
    assert bar.n == 5


def test_bar_is_closed_when_the_consumer_raises(bars: list[RecordingBar]) -> None:
    """An exception in the loop body closes the bar, at the exact value."""
    with cp.Loader(_pipe(), _cfg(2, None)) as loader, pytest.raises(ZeroDivisionError):
        for i, _ in enumerate(cp.progress(loader)):
            if i == 3:
                raise ZeroDivisionError
    (bar,) = bars
    assert bar.closed
    assert bar.n == 4 * BATCH


def test_resumed_bar_starts_at_the_checkpoint(bars: list[RecordingBar]) -> None:
    """After load_state_dict the bar starts at the checkpoint's weight."""
    k = 20
    with cp.Loader(_pipe(), _cfg(2, None)) as loader:
        it: Iterator[int] = iter(loader)
        head = [next(it) for _ in range(k)]
        sd = loader.state_dict()
    with cp.Loader(_pipe(), _cfg(2, 8)) as loader:
        loader.load_state_dict(sd)
        tail = list(cp.progress(loader, total=N))
    (bar,) = bars
    assert bar.initial_value == sum(head) == k * BATCH
    assert bar.n == N == sum(head) + sum(tail)


def test_each_epoch_starts_from_zero(bars: list[RecordingBar]) -> None:
    """A second pass starts a new epoch: the bar starts at 0 again."""
    with cp.Loader(_pipe(), _cfg(2, 8)) as loader:
        first = list(cp.progress(loader, total=N))
        second = list(cp.progress(loader, total=N))
    assert first == second
    assert [(b.initial_value, b.n) for b in bars] == [(0, N), (0, N)]


class _InterruptOnce(Sequence[int]):
    """A source whose ``[at]`` raises KeyboardInterrupt once, handing out nothing."""

    def __init__(self, n: int, at: int) -> None:
        self.n, self.at, self.fired = n, at, False

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:  # type: ignore[override]
        if i == self.at and not self.fired:
            self.fired = True
            raise KeyboardInterrupt
        if not 0 <= i < self.n:
            raise IndexError(i)
        return i


@pytest.mark.parametrize("parallel", [False, True], ids=["inline", "parallel-stage"])
def test_ctrl_c_leaves_the_bar_open_and_the_same_iterator_goes_on(
    bars: list[RecordingBar], parallel: bool
) -> None:
    """A Ctrl-C in the loader's ``next()`` reaches the loop; the same
    ``progress`` iterator then gives exactly the rest, and the bar ends exact.

    (A real Ctrl-C lands in the main thread: here the central chain runs in
    the consumer's thread, inline or driving a parallel stage.)"""
    pipe = (
        cp.Pipeline.from_iterable(_InterruptOnce(N, at=200))
        .batch(BATCH)
        .count("pre_shard", weight_fn=len)
        .map(_size, parallel=parallel)
        .dispatch()
    )
    with cp.Loader(pipe, _cfg(2 if parallel else 0, 8)) as loader:
        it = cp.progress(loader, min_interval_s=0)
        out = []
        with pytest.raises(KeyboardInterrupt):
            for size in it:
                out.append(size)
        (bar,) = bars
        assert not bar.closed
        assert bar.n == sum(out)
        out.extend(it)
    assert out == [BATCH] * (N // BATCH) + [N % BATCH]
    assert (bar.closed, bar.n) == (True, N)
