"""Worker processes: identical output for any num_workers, exact resume across
worker counts, buffers, start methods, queries under load and clean lifecycles."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import torch

import centralpipe as cp
from centralpipe.testing import assert_resumes_exactly
from tests.fns import faulty


def _noisy(x: int, rng: torch.Generator) -> float:
    return x + float(torch.rand(1, generator=rng))


def _odd(x: int) -> bool:
    return x % 2 == 1


def _pair(x: Any) -> list[Any]:
    return [x, x]


def _tokens(i: int) -> list[int]:
    return [i] * (1 + (i * 7919) % 13)


def _tensor(i: int) -> torch.Tensor:
    return torch.full((65536,), float(i))


def _cfg(workers: int, **kw: Any) -> cp.LoaderConfig:
    kw.setdefault("start_method", "fork")
    return cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=workers, **kw), seed=7)


def _mixed() -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(range(200))
        .shuffle(16)
        .count("seen")
        .batch(3)
        .dispatch()
        .flat_map(_pair)
        .map(sum)
        .map(_noisy, with_rng=True)
        .filter(lambda v: True)
    )


def _run(pipe: cp.Pipeline, cfg: cp.LoaderConfig) -> list[Any]:
    with cp.Loader(pipe, cfg) as loader:
        return list(loader)


def test_output_is_identical_for_any_worker_count() -> None:
    """0, 1, 2 and 3 workers give the same items in the same order, rng included."""
    expected = _run(_mixed(), _cfg(0))
    assert len(expected) == 2 * 67
    for workers in (1, 2, 3):
        assert _run(_mixed(), _cfg(workers, chunk_size=2)) == expected


@pytest.mark.parametrize(
    ("before", "after"),
    [(2, 2), (2, 0), (2, 3), (0, 2)],
    ids=["2to2", "2to0", "2to3", "0to2"],
)
def test_resume_exact_across_worker_counts(before: int, after: int) -> None:
    """Checkpoint at every k with one worker count, resume with another: exact."""
    pipe = (
        cp.Pipeline.from_iterable(range(30))
        .shuffle(8)
        .count("seen")
        .dispatch()
        .flat_map(_pair)
        .map(_noisy, with_rng=True)
    )
    assert_resumes_exactly(
        pipe, _cfg(before, buffer_size=10, chunk_size=3), resume_config=_cfg(after)
    )


def test_unlimited_buffer_with_large_bucket_buffer() -> None:
    """buffer_size=None with bucket_by_max_tokens(buffer_size=50_000) upstream."""
    pipe = (
        cp.Pipeline.from_iterable(range(3000))
        .map(_tokens)
        .bucket_by_max_tokens(64, buffer_size=50_000)
        .count("pre_shard", weight_fn=len)
        .dispatch()
        .map(len)
    )
    expected = _run(pipe, _cfg(0))
    assert sum(expected) == 3000
    with cp.Loader(pipe, _cfg(2, buffer_size=None)) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(50)]
        assert loader.query("pre_shard", delivered=True)["weight"] == sum(head)
        rest = list(it)
        assert head + rest == expected
    assert_resumes_exactly(pipe, _cfg(2, buffer_size=None), ks=[0, 1, 17, len(expected) - 1])


def test_buffer_of_one() -> None:
    """buffer_size=1 keeps one item in flight and still gives the exact output."""
    pipe = cp.Pipeline.from_iterable(range(50)).dispatch().map(faulty.identity)
    with cp.Loader(pipe, _cfg(2, buffer_size=1)) as loader:
        assert list(loader) == list(range(50))
        assert loader.metrics()["dispatch"]["buffer_high_water"] == 1
    assert_resumes_exactly(pipe, _cfg(2, buffer_size=1), ks=[0, 1, 25, 49, 50])


def test_bounded_buffer_is_respected() -> None:
    """The in-flight count never exceeds buffer_size."""
    pipe = cp.Pipeline.from_iterable(range(2000)).dispatch().map(faulty.identity)
    with cp.Loader(pipe, _cfg(2, buffer_size=37)) as loader:
        assert list(loader) == list(range(2000))
        assert loader.metrics()["dispatch"]["buffer_high_water"] <= 37


@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_every_start_method_gives_the_same_output(start_method: str) -> None:
    """fork, forkserver and spawn give identical output (module-level functions)."""
    pipe = (
        cp.Pipeline.from_iterable(range(100)).dispatch().flat_map(_pair).map(_noisy, with_rng=True)
    )
    assert _run(pipe, _cfg(2, start_method=start_method)) == _run(pipe, _cfg(0))


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_unpicklable_stage_function_names_the_stage(start_method: str) -> None:
    """A lambda with a pickling start method fails before any worker starts."""
    pipe = cp.Pipeline.from_iterable(range(3)).dispatch().map(lambda x: x, name="bad_fn")
    with pytest.raises(cp.PipelineError, match=r"bad_fn.*cannot be pickled"):
        cp.Loader(pipe, _cfg(2, start_method=start_method))


def test_default_start_method_is_forkserver() -> None:
    """The default start method is forkserver (safe with the feeder thread)."""
    assert cp.WorkerConfig(num_workers=2).resolved_start_method() == "forkserver"


def test_large_tensors_cross_the_process_boundary_intact() -> None:
    """256 KiB tensors from workers arrive equal, with dtype and shape."""
    pipe = cp.Pipeline.from_iterable(range(40)).dispatch().map(_tensor)
    out = _run(pipe, _cfg(2))
    assert all(t.dtype == torch.float32 and t.shape == (65536,) for t in out)
    assert [float(t[0]) for t in out] == [float(i) for i in range(40)]
    out[0].add_(1)  # received tensors are writable and own their memory


def test_live_query_runs_ahead_and_delivered_is_exact() -> None:
    """With workers the live count runs ahead of the consumer; the delivered
    count is exact at every step."""
    pipe = cp.Pipeline.from_iterable(range(500)).count("seen").dispatch().map(faulty.identity)
    with cp.Loader(pipe, _cfg(2, buffer_size=None)) as loader:
        for i, _ in enumerate(loader):
            assert loader.query("seen", delivered=True) == {"items": i + 1, "weight": i + 1}
            assert loader.query("seen")["items"] >= i + 1
        assert loader.query("seen", delivered=True) == {"items": 500, "weight": 500}


def test_query_from_another_thread_is_consistent() -> None:
    """query() from a monitoring thread while workers run returns whole states."""
    pipe = cp.Pipeline.from_iterable(range(3000)).count("seen").dispatch().map(faulty.identity)
    seen: list[dict[str, Any]] = []
    with cp.Loader(pipe, _cfg(2)) as loader:
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                seen.append(loader.query("seen"))

        t = threading.Thread(target=watch)
        t.start()
        try:
            assert list(loader) == list(range(3000))
        finally:
            stop.set()
            t.join(5)
    assert seen and all(s["items"] == s["weight"] for s in seen)


def test_metrics_report_workers_and_buffer() -> None:
    """metrics() has items per worker, waiting times and buffer figures."""
    pipe = cp.Pipeline.from_iterable(range(1000)).dispatch().map(faulty.identity)
    with cp.Loader(pipe, _cfg(2, buffer_size=64)) as loader:
        list(loader)
        d = loader.metrics()["dispatch"]
    assert sum(d["items_per_worker"]) == 1000 and all(n > 0 for n in d["items_per_worker"])
    assert d["dispatched"] == d["delivered"] == 1000
    assert 0 < d["buffer_high_water"] <= 64
    assert d["restarts"] == 0 and d["skipped"] == 0
    assert d["wait_workers_s"] >= 0 and d["wait_central_s"] >= 0


class CountingMap:
    """A stateful worker-stage callable: counts the items it saw."""

    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, x: int) -> int:
        self.seen += 1
        return x

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


@pytest.mark.parametrize("workers", [0, 2])
def test_worker_states_are_reported_per_worker(workers: int) -> None:
    """worker_states() asks each worker for its stateful stages' state."""
    pipe = cp.Pipeline.from_iterable(range(100)).dispatch().map(CountingMap(), name="counting")
    with cp.Loader(pipe, _cfg(workers, chunk_size=5)) as loader:
        assert list(loader) == list(range(100))
        states = loader.worker_states()
    assert len(states) == max(1, workers)
    assert sum(s["counting"]["seen"] for s in states) == 100


def test_workers_persist_across_epochs() -> None:
    """The same worker processes serve every epoch."""
    pipe = cp.Pipeline.from_iterable(range(50)).dispatch().map(faulty.identity)
    with cp.Loader(pipe, _cfg(2)) as loader:
        list(loader)
        pids = loader.worker_pids()
        list(loader)
        assert loader.worker_pids() == pids


def test_superseded_iterator_raises() -> None:
    """An iterator made stale by a new iter() raises instead of mixing epochs."""
    pipe = cp.Pipeline.from_iterable(range(5000)).dispatch().map(faulty.identity)
    with cp.Loader(pipe, _cfg(2, chunk_size=4)) as loader:
        old = iter(loader)
        next(old)
        new = iter(loader)
        with pytest.raises(RuntimeError, match="superseded"):
            for _ in range(100):
                next(old)
        assert next(new) == 0


def test_state_dict_mid_epoch_holds_only_builtins_and_tensors() -> None:
    """A mid-epoch checkpoint with workers has only builtins and tensors."""
    pipe = cp.Pipeline.from_iterable(range(100)).dispatch().map(_tensor)
    with cp.Loader(pipe, _cfg(2)) as loader:
        it = iter(loader)
        next(it)
        sd = loader.state_dict()

    def check(v: Any) -> None:
        if isinstance(v, dict):
            for key, value in v.items():
                assert isinstance(key, str)
                check(value)
        elif isinstance(v, (list, tuple)):
            for value in v:
                check(value)
        else:
            assert v is None or isinstance(v, (bool, int, float, str, bytes, torch.Tensor)), type(v)

    check(sd)
    gc.collect()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failing_item_runs_each_stage_once(workers: int) -> None:
    """When a later stage raises on an item, earlier (stateful) stages saw that
    item once, not again on a retry path."""
    import functools

    fn = functools.partial(faulty.raise_at, at=frozenset({5, 60}))
    pipe = (
        cp.Pipeline.from_iterable(range(100)).dispatch().map(CountingMap(), name="counting").map(fn)
    )
    with cp.Loader(pipe, _cfg(workers, on_error="skip", chunk_size=10)) as loader:
        assert list(loader) == [x for x in range(100) if x not in (5, 60)]
        states = loader.worker_states()
    assert sum(s["counting"]["seen"] for s in states) == 100


@pytest.mark.parametrize("workers", [0, 2])
def test_for_loop_over_a_temporary_loader(workers: int) -> None:
    """`for x in Loader(...)` keeps the loader alive while it iterates."""
    pipe = cp.Pipeline.from_iterable(range(300)).dispatch().map(faulty.identity)
    out = []
    for x in cp.Loader(pipe, _cfg(workers)):
        out.append(x)
    assert out == list(range(300))
    gc.collect()


@pytest.mark.parametrize("workers", [0, 2])
def test_worker_stage_mutating_items_in_place_resumes_exactly(workers: int) -> None:
    """A worker stage that mutates its item does not change the checkpoint:
    worker stages see a copy, inline too, so 0 and N workers agree."""
    pipe = (
        cp.Pipeline.from_iterable(range(20))
        .map(faulty.as_dict)
        .dispatch()
        .map(faulty.bump_in_place)
    )
    expected = [{"x": i + 100} for i in range(20)]
    assert _run(pipe, _cfg(workers)) == expected
    assert_resumes_exactly(pipe, _cfg(workers, chunk_size=4), ks=[0, 3, 10, 19, 20])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("bucketed", [False, True], ids=["token-lists", "buckets"])
def test_a_stage_appending_to_token_lists_resumes_exactly(workers: int, bucketed: bool) -> None:
    """Token lists, alone or in buckets, are copied for the worker stages
    inline by a structural copy (not a pickle round trip): a stage that
    appends to them still leaves the checkpoint's in-flight items as they
    were, with 0 workers as with 2."""
    pipe = cp.Pipeline.from_iterable(range(30)).map(faulty.tokens_of)
    if bucketed:
        pipe = pipe.batch(4)
    pipe = pipe.dispatch().map(faulty.append_in_place)
    tokens = [[*faulty.tokens_of(i), -1] for i in range(30)]
    expected = [tokens[i : i + 4] for i in range(0, 30, 4)] if bucketed else tokens
    assert _run(pipe, _cfg(workers)) == expected
    assert_resumes_exactly(pipe, _cfg(workers, chunk_size=3), ks=[0, 2, 5, len(expected)])


def test_worker_states_after_a_worker_died_between_epochs() -> None:
    """worker_states() between epochs replaces a worker that died meanwhile."""
    import os
    import signal
    import time

    pipe = cp.Pipeline.from_iterable(range(50)).dispatch().map(CountingMap(), name="counting")
    with cp.Loader(pipe, _cfg(2)) as loader:
        list(loader)
        os.kill(loader.worker_pids()[0], signal.SIGKILL)
        time.sleep(0.2)
        states = loader.worker_states()
        assert len(states) == 2
        assert list(loader) == list(range(50))
