"""The Loader: epochs, len, queries, metrics, state_dict, and its lifetime."""

from __future__ import annotations

import io
import time
from typing import Any

import pytest
import torch

import centralpipe as cp
from centralpipe.checkpoint import FORMAT_VERSION
from centralpipe.testing import _equal, collect
from tests.support.configs import loader_config

_config = loader_config


def _times2(x: int) -> int:
    return 2 * x


def _is_odd(x: int) -> bool:
    return x % 2 == 1


def _explode(batch: list[int]) -> list[int]:
    return list(batch)


def _three() -> Any:
    return iter([1, 2, 3])


def _identity(x: Any) -> Any:
    return x


class _CountingDataset:
    """A map-style dataset that counts `__getitem__` calls."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.calls += 1
        return i


# -- epochs --------------------------------------------------------------------------


def test_each_iter_is_the_next_epoch() -> None:
    """`loader.epoch` counts epochs started; each pass starts the next one at its first item."""
    with cp.Loader(cp.Pipeline.from_iterable([1, 2, 3])) as loader:
        assert loader.epoch == 0
        assert collect(loader) == [1, 2, 3]
        assert loader.epoch == 1
        it = iter(loader)
        assert loader.epoch == 1, "iter() alone starts nothing"
        assert next(it) == 1
        assert loader.epoch == 2
        assert collect(loader) == [1, 2, 3], "a new iter() abandons the unfinished epoch"
        assert loader.epoch == 3


def test_a_superseded_iterator_raises() -> None:
    """An iterator superseded by a newer `iter()` raises `RuntimeError` saying so."""
    with cp.Loader(cp.Pipeline.from_iterable([1, 2, 3])) as loader:
        old = iter(loader)
        new = iter(loader)
        with pytest.raises(RuntimeError, match="superseded"):
            next(old)
        assert list(new) == [1, 2, 3]


def test_shuffle_reseeds_every_epoch() -> None:
    """A shuffle gives a new permutation each epoch, repeatable by a new Loader."""
    pipe = cp.Pipeline.from_iterable(range(30)).shuffle(30)
    with cp.Loader(pipe) as loader:
        epochs = [collect(loader) for _ in range(3)]
    with cp.Loader(pipe) as loader:
        assert [collect(loader) for _ in range(3)] == epochs
    assert len({tuple(e) for e in epochs}) == 3
    assert all(sorted(e) == list(range(30)) for e in epochs)


# -- len ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pipe", "expected"),
    [
        (cp.Pipeline.from_iterable([1, 2, 3, 4, 5]), 5),
        (cp.Pipeline.from_iterable(list(range(10))).map(_times2).batch(3), 4),
        (cp.Pipeline.from_iterable(list(range(10))).map(_times2).batch(3, drop_last=True), 3),
        (cp.Pipeline.from_iterable(range(7)).shuffle(3).count().batch(2), 4),
        (cp.Pipeline.from_iterable(range(7)).batch(2).dispatch().collate().map(len), 4),
        (cp.Pipeline.from_dataset([5, 6, 7]), 3),
        (cp.Pipeline.from_iterable([]), 0),
    ],
    ids=[
        "list",
        "map-batch",
        "batch-drop-last",
        "shuffle-count",
        "worker-maps",
        "dataset",
        "empty",
    ],
)
def test_len_when_known(pipe: cp.Pipeline, expected: int) -> None:
    """`len(loader)` is the per-epoch count when it is known without iterating."""
    with cp.Loader(pipe) as loader:
        assert len(loader) == expected
        assert len(collect(loader)) == expected


@pytest.mark.parametrize(
    ("world_size", "equalize", "lengths"),
    [
        (3, None, [4, 3, 3]),
        (3, "drop_last", [3, 3, 3]),
        (3, "pad", [4, 4, 4]),
        (4, None, [3, 3, 2, 2]),
    ],
    ids=["plain", "drop_last", "pad", "w4"],
)
def test_len_of_a_shard(world_size: int, equalize: str | None, lengths: list[int]) -> None:
    """`len()` of a sharded loader is the count of this rank's shard."""
    pipe = cp.Pipeline.from_iterable(range(10)).batch(1).shard(equalize=equalize)  # type: ignore[arg-type]
    for rank, expected in enumerate(lengths):
        with cp.Loader(pipe, _config(rank=rank, world_size=world_size)) as loader:
            assert len(loader) == expected
            assert len(collect(loader)) == expected


@pytest.mark.parametrize(
    ("pipe", "stage"),
    [
        (cp.Pipeline.from_iterable(range(5)).filter(_is_odd), "filter_1"),
        (cp.Pipeline.from_iterable(range(5)).flat_map(_explode), "flat_map_1"),
        (
            cp.Pipeline.from_iterable(range(5)).bucket_by_max_tokens(3, len_fn=_times2),
            "bucket_by_max_tokens_1",
        ),
        (cp.Pipeline.from_iterable(_three), "source"),
        (cp.Pipeline.from_iterable(range(5)).dispatch().filter(_is_odd), "filter_2"),
        (cp.Pipeline.from_iterable(range(5)).dispatch().flat_map(_explode), "flat_map_2"),
    ],
    ids=["filter", "flat_map", "bucket", "factory", "worker-filter", "worker-flat_map"],
)
def test_len_unknown_raises_type_error(pipe: cp.Pipeline, stage: str) -> None:
    """`len()` raises `TypeError` naming the stage when only iterating would tell."""
    with (
        cp.Loader(pipe) as loader,
        pytest.raises(TypeError, match="not known without iterating") as info,
    ):
        len(loader)
    assert f"stage '{stage}'" in str(info.value)


# -- query ----------------------------------------------------------------------------


def test_query_unknown_name_lists_the_stages() -> None:
    """An unknown name raises `KeyError` listing every central stage."""
    pipe = cp.Pipeline.from_iterable([1]).count("c").dispatch().map(_times2, name="w")
    with cp.Loader(pipe) as loader:
        with pytest.raises(KeyError, match=r"no central stage named 'nope'.*'source', 'c'"):
            loader.query("nope")
        with pytest.raises(KeyError, match="'w' is a worker stage"):
            loader.query("w")


def test_query_delivered_needs_a_count_stage() -> None:
    """`delivered=True` on a stage that is not a `count` raises `ValueError`."""
    pipe = cp.Pipeline.from_iterable([1, 2]).shuffle(2).count("c")
    with cp.Loader(pipe) as loader:
        with pytest.raises(ValueError, match="'shuffle_1' is a shuffle stage"):
            loader.query("shuffle_1", delivered=True)
        assert loader.query("c", delivered=True) == {"items": 0, "weight": 0}


def test_query_is_a_copy() -> None:
    """Changing what `query()` returned does not change the stage."""
    with cp.Loader(cp.Pipeline.from_iterable([1, 2]).count("c")) as loader:
        collect(loader)
        got = loader.query("c")
        got["items"] = 99
        assert loader.query("c") == {"items": 2, "weight": 2}


def test_query_live_view_runs_ahead() -> None:
    """The live view counts what the central stages pulled, ahead of the consumer."""
    pipe = cp.Pipeline.from_iterable(range(100)).count("c")
    with cp.Loader(pipe, _config(buffer_size=None, chunk_size=10)) as loader:
        it = iter(loader)
        assert loader.query("c") == {"items": 0, "weight": 0}
        next(it)
        assert loader.query("c") == {"items": 10, "weight": 10}
        assert loader.query("c", delivered=True) == {"items": 1, "weight": 1}


DELIVERED_CONFIGS = {
    "buffer-1": _config(buffer_size=1),
    "buffer-4": _config(buffer_size=4, chunk_size=2),
    "unlimited": _config(buffer_size=None),
    "unlimited-chunk-3": _config(buffer_size=None, chunk_size=3),
    "workers-2": _config(num_workers=2, buffer_size=None, chunk_size=2),
}


@pytest.mark.parametrize("config", list(DELIVERED_CONFIGS.values()), ids=list(DELIVERED_CONFIGS))
def test_query_delivered_is_exact_at_every_step(config: cp.LoaderConfig) -> None:
    """`delivered=True` counts exactly the source items behind the outputs delivered so far."""
    n, size = 20, 3
    pipe = (
        cp.Pipeline.from_iterable(range(n))
        .count("src", weight_fn=_identity)
        .batch(size)
        .count("batches", weight_fn=len)
        .dispatch()
        .flat_map(_explode)
    )
    with cp.Loader(pipe, config) as loader:
        delivered: list[int] = []
        for x in loader:
            delivered.append(x)
            consumed = min(n, (x // size + 1) * size)  # the whole batch of x was pulled
            assert loader.query("src", delivered=True) == {
                "items": consumed,
                "weight": sum(range(consumed)),
            }, f"after {len(delivered)} outputs"
            assert loader.query("batches", delivered=True) == {
                "items": x // size + 1,
                "weight": consumed,
            }
            live = loader.query("src")
            assert consumed <= live["items"] <= n
        assert delivered == list(range(n))
        assert loader.query("src", delivered=True) == {"items": n, "weight": sum(range(n))}


def test_query_delivered_after_resume() -> None:
    """After `load_state_dict`, `delivered=True` is the checkpoint's delivered totals."""
    pipe = cp.Pipeline.from_iterable(range(10)).count("c").batch(2)
    with cp.Loader(pipe, _config(buffer_size=None)) as loader:
        it = iter(loader)
        next(it)
        next(it)
        state = loader.state_dict()
        assert loader.query("c") == {"items": 10, "weight": 10}
    with cp.Loader(pipe) as resumed:
        resumed.load_state_dict(state)
        assert resumed.query("c", delivered=True) == {"items": 4, "weight": 4}
        it = iter(resumed)
        assert next(it) == [4, 5]
        assert resumed.query("c", delivered=True) == {"items": 6, "weight": 6}


# -- metrics ----------------------------------------------------------------------------


def test_metrics_keys_and_counts() -> None:
    """`metrics()` has items in/out and time per central stage, and a `dispatch` dict."""
    pipe = cp.Pipeline.from_iterable(range(10)).filter(_is_odd).batch(2).dispatch().map(len)
    with cp.Loader(pipe) as loader:
        assert collect(loader) == [2, 2, 1]
        m = loader.metrics()
    assert list(m) == ["source", "filter_1", "batch_2", "dispatch"]
    for name in ("source", "filter_1", "batch_2"):
        assert set(m[name]) == {"items_in", "items_out", "time_s"}
        assert m[name]["time_s"] >= 0.0
    assert m["source"]["items_in"] is None
    assert (m["source"]["items_out"], m["filter_1"]["items_in"]) == (10, 10)
    assert (m["filter_1"]["items_out"], m["batch_2"]["items_in"]) == (5, 5)
    assert m["batch_2"]["items_out"] == 3
    d = m["dispatch"]
    assert {
        "num_workers",
        "buffered",
        "buffer_size",
        "buffer_high_water",
        "skipped",
        "restarts",
    } <= set(d)
    assert (d["num_workers"], d["skipped"], d["restarts"]) == (0, 0, 0)
    assert (d["dispatched"], d["delivered"], d["buffered"]) == (3, 3, 0)
    assert 1 <= d["buffer_high_water"] <= 3


SLEEP_S = 0.0005


def _sleepy(n: int) -> Any:
    """A zero-argument callable: ``n`` token lists, each after a ``SLEEP_S`` sleep."""

    def items() -> Any:
        for i in range(n):
            time.sleep(SLEEP_S)
            yield [i] * (i % 7 + 1)

    return items


def _same(x: Any) -> Any:
    return x


def _sleepy_pipeline(shape: str) -> tuple[cp.Pipeline, dict[str, int]]:
    """A fast chain over sleeping sources; the items each source yields, by name."""
    if shape == "mix":
        sources = {"a": cp.Pipeline.from_iterable(_sleepy(60), name="src")}
        sources["b"] = cp.Pipeline.from_iterable(_sleepy(40), name="src")
        pipe = cp.Pipeline.mix(sources, {"a": 1, "b": 1}, name="mix")
        slept = {"mix/a/src": 60, "mix/b/src": 40}
    else:
        pipe = cp.Pipeline.from_iterable(_sleepy(100), name="src")
        slept = {"src": 100}
    pipe = pipe.map(_same, parallel=shape == "parallel", name="m")
    # An unlimited buffer: the bucket's first call reads the whole epoch.
    pipe = pipe.bucket_by_max_tokens(20, buffer_size=None, name="b").count("c", weight_fn=len)
    return pipe.batch(2, name="bt").dispatch().map(_same), slept


@pytest.mark.parametrize("num_workers", [0, 2], ids=["inline", "2-workers"])
@pytest.mark.parametrize("shape", ["chain", "parallel", "mix"])
def test_stage_times_are_own_times_within_the_epoch(shape: str, num_workers: int) -> None:
    """Each stage's ``time_s`` is its own, without its source's: a sleeping
    source has at least its sleeps, and all stages together no more than the
    epoch's wall time (a bucket that reads the whole epoch in one call
    reported 16 times the source's time)."""
    pipe, slept = _sleepy_pipeline(shape)
    start = time.perf_counter()
    with cp.Loader(pipe, loader_config(num_workers=num_workers)) as loader:
        buckets = [bucket for batch in loader for bucket in batch]
        wall_s = time.perf_counter() - start
        assert sum(map(len, buckets)) == loader.query("c")["weight"] == sum(slept.values())
        m = loader.metrics()
    own = {name: v["time_s"] for name, v in m.items() if name != "dispatch"}
    assert set(own) == {*slept, "m", "b", "c", "bt", *(["mix"] if shape == "mix" else [])}
    for name, n in slept.items():
        assert own[name] >= n * SLEEP_S, name
    assert sum(own.values()) <= wall_s
    assert all(t >= 0.0 for t in own.values())


def test_metrics_of_a_fresh_loader() -> None:
    """`metrics()` works before any iteration, with zero counts."""
    with cp.Loader(cp.Pipeline.from_iterable([1]).dispatch()) as loader:
        m = loader.metrics()
    assert m["source"]["items_out"] == 0
    assert m["dispatch"]["dispatched"] == 0


# -- state_dict ---------------------------------------------------------------------------


def test_state_dict_never_iterates() -> None:
    """Taking `state_dict()` 100 times reads nothing from the source."""
    data = _CountingDataset(50)
    pipe = cp.Pipeline.from_dataset(data).batch(2).dispatch().map(len)
    with cp.Loader(pipe, _config(chunk_size=4)) as loader:
        for _ in range(100):
            loader.state_dict()
        assert data.calls == 0
        it = iter(loader)
        for _ in range(100):
            loader.state_dict()
        assert data.calls == 0
        next(it)
        calls = data.calls
        assert calls == 8, "one chunk of 4 batches of 2"
        for _ in range(100):
            loader.state_dict()
        assert data.calls == calls


_BUILTIN_LEAVES = (bool, int, float, str, bytes, type(None), torch.Tensor)


def _non_builtin_paths(value: Any, path: str = "sd") -> list[str]:
    if isinstance(value, dict):
        bad = [f"{path} key {k!r}" for k in value if not isinstance(k, str)]
        for k, v in value.items():
            bad += _non_builtin_paths(v, f"{path}[{k!r}]")
        return bad
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _non_builtin_paths(v, f"{path}[{i}]")]
    if type(value) in _BUILTIN_LEAVES or isinstance(value, torch.Tensor):
        return []
    return [f"{path}: {type(value).__module__}.{type(value).__qualname__}"]


def _rich_pipeline() -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable([torch.tensor([i, i]) for i in range(30)])
        .shuffle(5)
        .count("c", weight_fn=len)
        .bucket_by_max_tokens(6, buffer_size=3)
        .shard(equalize="pad")
        .dispatch()
        .flat_map(_explode)
    )


@pytest.mark.parametrize("k", [0, 1, 4, 17], ids=lambda k: f"k={k}")
def test_state_dict_holds_only_builtins_and_tensors(k: int) -> None:
    """Every value in a checkpoint is a builtin or a tensor; every key a str."""
    with cp.Loader(_rich_pipeline(), _config(buffer_size=8, chunk_size=3)) as loader:
        it = iter(loader)
        for _ in range(k):
            next(it)
        state = loader.state_dict()
    assert _non_builtin_paths(state) == []
    assert state["format_version"] == FORMAT_VERSION == 2
    assert isinstance(state["format_version"], int)


def test_state_dict_survives_torch_save_and_load() -> None:
    """A checkpoint written with `torch.save` loads back (also with `weights_only=True`)."""
    pipe = _rich_pipeline()
    config = _config(buffer_size=8, chunk_size=3)
    with cp.Loader(pipe, config) as loader:
        full = collect(loader)
    with cp.Loader(pipe, config) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(7)]
        buffer = io.BytesIO()
        torch.save(loader.state_dict(), buffer)
    for weights_only in (False, True):
        buffer.seek(0)
        state = torch.load(buffer, weights_only=weights_only)
        with cp.Loader(pipe, config) as resumed:
            resumed.load_state_dict(state)
            rest = collect(resumed)
        assert _equal(head + rest, full)


def test_epoch_after_load_is_the_checkpoints() -> None:
    """After `load_state_dict`, `loader.epoch` is the checkpoint's; iterating continues it."""
    pipe = cp.Pipeline.from_iterable(range(6)).shuffle(6)
    with cp.Loader(pipe) as loader:
        collect(loader)
        collect(loader)
        it = iter(loader)
        head = [next(it), next(it)]
        state = loader.state_dict()
        third = head + list(it)
    assert state["epoch"] == 3
    with cp.Loader(pipe) as resumed:
        resumed.load_state_dict(state)
        assert resumed.epoch == 3
        assert head + collect(resumed) == third
        assert resumed.epoch == 3
        collect(resumed)
        assert resumed.epoch == 4


def test_state_dict_at_end_of_epoch_resumes_into_the_next() -> None:
    """A checkpoint after an epoch ended makes the next `iter()` start the next epoch."""
    pipe = cp.Pipeline.from_iterable(range(8)).shuffle(8)
    with cp.Loader(pipe) as loader:
        collect(loader)
        state = loader.state_dict()
        second = collect(loader)
    assert state["finished"] is True
    assert state["epoch"] == 1
    with cp.Loader(pipe) as resumed:
        resumed.load_state_dict(state)
        assert resumed.epoch == 1
        assert collect(resumed) == second
        assert resumed.epoch == 2


def test_state_dict_of_a_fresh_loader_starts_at_epoch_one() -> None:
    """A checkpoint taken before iterating resumes at the start of the first epoch."""
    pipe = cp.Pipeline.from_iterable(range(5)).shuffle(5)
    with cp.Loader(pipe) as loader:
        state = loader.state_dict()
        first = collect(loader)
    assert state["epoch"] == 0
    with cp.Loader(pipe) as resumed:
        resumed.load_state_dict(state)
        assert collect(resumed) == first
        assert resumed.epoch == 1


def test_state_dict_after_load_is_the_loaded_one() -> None:
    """Before iterating, `state_dict()` returns the loaded checkpoint, as a copy."""
    pipe = cp.Pipeline.from_iterable(range(5)).count("c")
    with cp.Loader(pipe, _config(buffer_size=1)) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    with cp.Loader(pipe) as resumed:
        resumed.load_state_dict(state)
        again = resumed.state_dict()
        assert again == state
        again["in_flight"]["dispatch"]["items"].append(99)
        assert resumed.state_dict() == state


def test_checkpoint_every_step_with_workers_resumes_inline() -> None:
    """Checkpoints taken while 2 workers run resume exactly with none, and back."""
    from centralpipe.testing import assert_resumes_exactly

    pipe = (
        cp.Pipeline.from_iterable(range(24)).shuffle(6).batch(2).dispatch().map(sum).filter(_is_odd)
    )
    ks = [0, 1, 3, 6]
    full = assert_resumes_exactly(
        pipe, _config(num_workers=2, buffer_size=4), resume_config=_config(), ks=ks
    )
    assert full == assert_resumes_exactly(
        pipe, _config(), resume_config=_config(num_workers=2), ks=ks
    )


# -- lifetime -----------------------------------------------------------------------------


def test_close_is_idempotent_and_final() -> None:
    """`close()` twice is fine; afterwards iterating or checkpointing raises `RuntimeError`."""
    loader = cp.Loader(cp.Pipeline.from_iterable([1, 2]))
    state = loader.state_dict()
    loader.close()
    loader.close()
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)
    with pytest.raises(RuntimeError, match="closed"):
        loader.state_dict()
    with pytest.raises(RuntimeError, match="closed"):
        loader.load_state_dict(state)


def test_context_manager_closes() -> None:
    """`with Loader(...)` closes the loader on exit, also on an exception."""
    with cp.Loader(cp.Pipeline.from_iterable([1, 2])) as loader:
        assert collect(loader) == [1, 2]
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)
    with pytest.raises(ZeroDivisionError), cp.Loader(cp.Pipeline.from_iterable([1])) as other:
        next(iter(other))
        raise ZeroDivisionError
    with pytest.raises(RuntimeError, match="closed"):
        iter(other)


def test_close_mid_epoch_with_workers() -> None:
    """Closing a loader with workers in the middle of an epoch leaves nothing running."""
    pipe = cp.Pipeline.from_iterable(range(1000)).dispatch().map(_times2)
    with cp.Loader(pipe, _config(num_workers=2, buffer_size=16)) as loader:
        it = iter(loader)
        assert [next(it) for _ in range(3)] == [0, 2, 4]


def test_an_iterator_stops_after_close() -> None:
    """An iterator of a closed loader ends with `RuntimeError` (at the latest after its chunk)."""
    loader = cp.Loader(cp.Pipeline.from_iterable(range(100)).dispatch(), _config(chunk_size=4))
    it = iter(loader)
    next(it)
    loader.close()
    with pytest.raises(RuntimeError, match="superseded"):
        for _ in range(4):
            next(it)


@pytest.mark.parametrize("how", ["iter", "close", "load_state_dict"])
def test_a_superseded_iterator_yields_nothing_more(how: str) -> None:
    """Once superseded, a started iterator raises at its very next item."""
    loader = cp.Loader(cp.Pipeline.from_iterable(range(100)).dispatch(), _config(chunk_size=16))
    state = loader.state_dict()
    it = iter(loader)
    assert next(it) == 0
    if how == "iter":
        iter(loader)
    elif how == "close":
        loader.close()
    else:
        loader.load_state_dict(state)
    try:
        with pytest.raises(RuntimeError, match="superseded"):
            next(it)
    finally:
        loader.close()


def test_loader_exposes_its_pipeline_and_config() -> None:
    """`loader.pipeline` and `loader.config` are what it was built with (default config)."""
    pipe = cp.Pipeline.from_iterable([1])
    with cp.Loader(pipe) as loader:
        assert loader.pipeline is pipe
        assert loader.config == cp.LoaderConfig()


@pytest.mark.parametrize("num_workers", [0, 2], ids=lambda n: f"workers={n}")
def test_checkpoints_while_iterating_change_nothing(num_workers: int) -> None:
    """Checkpoints and queries at every step change no output, and each resumes exactly."""
    pipe = (
        cp.Pipeline.from_iterable(range(40))
        .shuffle(7)
        .count("c")
        .batch(3)
        .dispatch()
        .flat_map(_explode)
    )
    config = _config(num_workers=num_workers, buffer_size=6, chunk_size=2)
    with cp.Loader(pipe, _config()) as loader:
        full = collect(loader)
    states = []
    with cp.Loader(pipe, config) as loader:
        got = []
        states.append(loader.state_dict())
        for item in loader:
            got.append(item)
            loader.query("c")
            loader.query("c", delivered=True)
            states.append(loader.state_dict())
    assert got == full
    for k in (0, 1, 2, 13, 39, 40):
        with cp.Loader(pipe, _config()) as resumed:
            resumed.load_state_dict(states[k])
            assert collect(resumed) == full[k:], f"k={k}"


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "workers"])
def test_next_on_an_ended_iterator_starts_no_epoch(workers: int) -> None:
    """next() on an iterator whose epoch ended raises StopIteration again: it
    neither starts the next epoch nor moves the checkpoint; a new iter() does."""
    pipe = cp.Pipeline.from_iterable(range(5)).dispatch()
    with cp.Loader(pipe, loader_config(num_workers=workers)) as loader:
        it = iter(loader)
        assert list(it) == [0, 1, 2, 3, 4]
        state = loader.state_dict()
        for _ in range(3):
            with pytest.raises(StopIteration):
                next(it)
        assert loader.state_dict() == state
        assert list(loader) == [0, 1, 2, 3, 4]
        assert loader.state_dict()["epoch"] == state["epoch"] + 1
