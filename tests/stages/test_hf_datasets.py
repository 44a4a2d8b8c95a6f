"""Hugging Face ``datasets``: a map-style ``Dataset`` through ``from_dataset``, an
``IterableDataset`` through ``from_iterable``, checkpointed by its own state_dict."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.testing import assert_resumes_exactly, collect
from tests.support.configs import loader_config

datasets = pytest.importorskip("datasets")

LOCKSTEP = loader_config(buffer_size=1, chunk_size=1)
N = 23


def _table() -> Any:
    return datasets.Dataset.from_dict({"id": list(range(N)), "text": [f"t{i}" for i in range(N)]})


def _double(row: dict[str, Any]) -> int:
    return row["id"] * 2


@pytest.mark.parametrize(
    ("workers", "resume_workers"), [(0, 0), (2, 0), (2, 2)], ids=["0-0", "2-0", "2-2"]
)
def test_map_style_dataset_resumes_by_index(workers: int, resume_workers: int) -> None:
    """A real datasets.Dataset is read by index and resumes exactly at every k."""
    pipe = cp.Pipeline.from_dataset(_table()).dispatch().map(_double)
    full = assert_resumes_exactly(
        pipe,
        loader_config(num_workers=workers),
        resume_config=loader_config(num_workers=resume_workers),
        ks=None if workers == 0 else [0, 1, 7, N - 1, N],
    )
    assert full == [2 * i for i in range(N)]


def _gen() -> Iterator[dict[str, Any]]:
    yield from ({"id": i} for i in range(N))


ITERABLES = {
    "arrow-shards": lambda: _table().to_iterable_dataset(num_shards=3),
    "generator": lambda: datasets.IterableDataset.from_generator(_gen),
    "mapped": lambda: _table().to_iterable_dataset(num_shards=2).map(lambda r: {"id": r["id"]}),
}


@pytest.mark.parametrize("make", list(ITERABLES.values()), ids=list(ITERABLES))
@pytest.mark.parametrize(("workers", "resume_workers"), [(0, 0), (2, 0)], ids=["0-0", "2-0"])
def test_iterable_dataset_resumes_through_its_state_dict(
    make: Any, workers: int, resume_workers: int
) -> None:
    """An IterableDataset resumes exactly at every k over two epochs, by its own state."""
    pipe = cp.Pipeline.from_iterable(make()).dispatch().map(lambda r: r["id"])
    full = assert_resumes_exactly(
        pipe,
        loader_config(num_workers=workers),
        resume_config=loader_config(num_workers=resume_workers),
        epochs=2,
        ks=None if workers == 0 else [0, 1, 7, N - 1, N, N + 5, 2 * N],
    )
    assert sorted(full[:N]) == list(range(N))
    assert full[N:] == full[:N]


def test_the_state_is_the_datasets_own() -> None:
    """The checkpoint holds the dataset's state_dict() after the items yielded."""
    ds = _table().to_iterable_dataset(num_shards=3)
    direct = _table().to_iterable_dataset(num_shards=3)
    it = iter(direct)
    for _ in range(8):
        next(it)
    pipe = cp.Pipeline.from_iterable(ds)
    with cp.Loader(pipe, LOCKSTEP) as loader:
        got = iter(loader)
        for _ in range(8):
            next(got)
        state = loader.state_dict()["central"]["source"]
    assert state == {"index": 8, "state": direct.state_dict()}


def test_a_shuffle_buffer_is_refused() -> None:
    """A shuffle buffer (lost on resume) is a PipelineError saying what to use instead."""
    ds = _table().to_iterable_dataset(num_shards=3).shuffle(seed=0, buffer_size=4)
    pipe = cp.Pipeline.from_iterable(ds)
    with pytest.raises(cp.PipelineError, match=r"cannot resume exactly: it has a shuffle buffer"):
        cp.Loader(pipe)


def test_two_live_loaders_over_one_dataset_are_refused() -> None:
    """One IterableDataset object keeps one position: a second live Loader is refused."""
    pipe = cp.Pipeline.from_iterable(_table().to_iterable_dataset())
    with cp.Loader(pipe) as first:
        with pytest.raises(cp.PipelineError, match="already read by another live Loader"):
            cp.Loader(pipe)
        assert [r["id"] for r in collect(first)] == list(range(N))
    with cp.Loader(pipe) as again:  # closed: free again
        assert len(collect(again)) == N


@pytest.mark.parametrize(
    ("changes", "match"),
    [({"state": [1]}, "state must be the object's state_dict"), ({"index": -1}, "index must be")],
    ids=["state-not-a-dict", "negative-index"],
)
def test_damaged_states_are_refused(changes: dict[str, Any], match: str) -> None:
    """A state that is not a dict, or a negative index, is a CheckpointError at load."""
    pipe = cp.Pipeline.from_iterable(_table().to_iterable_dataset())
    with cp.Loader(pipe, LOCKSTEP) as loader:
        it = iter(loader)
        next(it)
        state = copy.deepcopy(loader.state_dict())
    state["central"]["source"].update(changes)
    with cp.Loader(pipe, LOCKSTEP) as loader, pytest.raises(cp.CheckpointError, match=match):
        loader.load_state_dict(state)


class Countdown:
    """A re-iterable of its own making that keeps its position (no datasets)."""

    def __init__(self, n: int) -> None:
        self.n, self.done = n, 0

    def __iter__(self) -> Iterator[int]:
        while self.done < self.n:
            self.done += 1
            yield self.n - self.done

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.done = state["done"]


def test_any_stateful_iterable_is_checkpointed_through_its_state() -> None:
    """Any iterable with state_dict/load_state_dict resumes through them, never by skipping."""
    source = Countdown(12)
    pipe = cp.Pipeline.from_iterable(source)
    assert assert_resumes_exactly(pipe, LOCKSTEP, epochs=2) == [*range(11, -1, -1)] * 2
    with cp.Loader(pipe, LOCKSTEP) as loader:
        it = iter(loader)
        for _ in range(5):
            next(it)
        assert loader.state_dict()["central"]["source"] == {"index": 5, "state": {"done": 5}}


class Batched:
    """A map-style dataset with torch's batched ``__getitems__``, counting calls."""

    def __init__(self, n: int) -> None:
        self.n, self.batched, self.single = n, 0, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.single += 1
        return i * 3

    def __getitems__(self, keys: list[int]) -> list[int]:
        self.batched += 1
        return [i * 3 for i in keys]


def test_a_batched_getitems_is_used_in_bulk_and_resumes_by_index() -> None:
    """from_dataset fetches chunks through __getitems__ (as datasets.Dataset offers),
    giving the same items as indexing, and resumes exactly."""
    data = Batched(40)
    pipe = cp.Pipeline.from_dataset(data).dispatch()
    config = loader_config(num_workers=2, chunk_size=8)
    full = assert_resumes_exactly(pipe, config, ks=[0, 1, 9, 39, 40])
    assert full == [3 * i for i in range(40)]
    assert data.batched > 0 and data.single == 0


class Tripping(Countdown):
    """A Countdown whose ``k``-th item raises KeyboardInterrupt instead (once)."""

    def __init__(self, n: int, k: int) -> None:
        super().__init__(n)
        self.k, self.tripped = k, False

    def __iter__(self) -> Iterator[int]:
        for item in super().__iter__():
            if self.done == self.k and not self.tripped:
                self.tripped = True
                self.done -= 1  # the item was not handed out
                raise KeyboardInterrupt(f"injected at item {self.k}")
            yield item


def _chain_of(pipe: cp.Pipeline) -> Any:
    from centralpipe.stages import RunContext, build_central

    nodes = build_central(pipe.central_stages, RunContext())
    nodes[-1].load_flat(None)
    return nodes[-1]


@pytest.mark.parametrize("n", [1, 4, 64], ids=["single", "bulk-4", "bulk-64"])
def test_bulk_pulls_of_a_stateful_iterable_count_only_what_they_hand_out(n: int) -> None:
    """pull_into(n) slices the iterable in bulk; a Ctrl-C inside it keeps the items
    already handed out, and the next pulls go on from its own state, nothing lost
    or repeated, with the index and state of the items handed out."""
    tip = _chain_of(cp.Pipeline.from_iterable(Tripping(12, k=7)))
    got: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        while True:
            tip.pull_into(got, n)
    assert got == [11, 10, 9, 8, 7, 6]
    assert tip.own_state() == {"index": 6, "state": {"done": 6}}
    with pytest.raises(StopIteration):
        while True:
            tip.pull_into(got, n)
    assert got == list(range(11, -1, -1))
    assert tip.own_state() == {"index": 12, "state": {"done": 12}}
