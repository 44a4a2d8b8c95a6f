"""map(fn, batched=True): one call per chunk with a list of items, same items and checkpoints."""

from __future__ import annotations

from typing import Any

import pytest

import centralpipe as cp
from centralpipe.testing import assert_resumes_exactly, collect

CALLS: list[int] = []
BAD = 13


def _one(x: int) -> tuple[int, int]:
    return x, x * x


def _many(xs: list[int]) -> list[tuple[int, int]]:
    CALLS.append(len(xs))
    return [_one(x) for x in xs]


def _many_failing(xs: list[int]) -> list[tuple[int, int]]:
    if BAD in xs:
        raise ValueError(f"cannot take {BAD}")
    return [_one(x) for x in xs]


def _too_few(xs: list[int]) -> list[tuple[int, int]]:
    return [_one(x) for x in xs[1:]]


def _not_a_list(xs: list[int]) -> int:
    return len(xs)


def _cfg(workers: int, executor: str = "process", **kw: Any) -> cp.LoaderConfig:
    w = cp.WorkerConfig(
        num_workers=workers, executor=executor, start_method="fork", chunk_size=5, **kw
    )
    return cp.LoaderConfig(workers=w)


def _parallel(fn: Any, n: int = 40) -> cp.Pipeline:
    return cp.Pipeline.from_iterable(range(n)).map(fn, parallel=True, batched=True, name="enc")


EXPECTED = [_one(x) for x in range(40)]
CONFIGS = [
    pytest.param(w, ex, id=f"{w}w-{ex}")
    for w, ex in [(0, "process"), (1, "process"), (2, "process"), (3, "process"), (2, "thread")]
]


@pytest.mark.parametrize(("workers", "executor"), CONFIGS)
def test_a_batched_parallel_map_gives_the_per_item_outputs(workers: int, executor: str) -> None:
    """Outputs of a batched parallel map equal fn per item, in order, everywhere."""
    with cp.Loader(_parallel(_many).batch(4), _cfg(workers, executor)) as loader:
        assert collect(loader) == [EXPECTED[i : i + 4] for i in range(0, 40, 4)]


@pytest.mark.parametrize(("workers", "executor"), CONFIGS)
def test_a_batched_worker_map_after_dispatch(workers: int, executor: str) -> None:
    """A batched map after dispatch() gives the per-item outputs too."""
    pipe = cp.Pipeline.from_iterable(range(40)).dispatch().map(_many, batched=True)
    with cp.Loader(pipe, _cfg(workers, executor)) as loader:
        assert collect(loader) == EXPECTED


def test_fn_is_called_once_per_chunk() -> None:
    """With thread workers and chunks of 5, fn sees lists of 5 items: one call per chunk."""
    CALLS.clear()
    with cp.Loader(_parallel(_many), _cfg(2, "thread")) as loader:
        assert collect(loader) == EXPECTED
    assert CALLS == [5] * 8


@pytest.mark.parametrize(("workers", "executor"), CONFIGS)
def test_only_the_failing_item_fails(workers: int, executor: str) -> None:
    """When the batched call raises, items are tried one by one: only the bad one is skipped."""
    with cp.Loader(_parallel(_many_failing), _cfg(workers, executor, on_error="skip")) as loader:
        assert collect(loader) == [e for e in EXPECTED if e[0] != BAD]
        assert loader.metrics()["dispatch"]["skipped"] == 1


def test_a_failing_item_raises_a_worker_error_naming_it() -> None:
    """With on_error="raise" the failing item is a WorkerError naming the stage and its seq."""
    loader = cp.Loader(_parallel(_many_failing), _cfg(2))
    with loader, pytest.raises(cp.WorkerError, match=f"cannot take {BAD}") as info:
        collect(loader)
    assert info.value.stage == "enc" and info.value.seq == BAD


@pytest.mark.parametrize(
    ("fn", "text"),
    [
        pytest.param(_too_few, "one output per item", id="too-few-outputs"),
        pytest.param(_not_a_list, "must return a list", id="not-a-list"),
    ],
)
def test_wrong_outputs_are_worker_errors(fn: Any, text: str) -> None:
    """A batched fn returning the wrong number or kind of outputs is a WorkerError saying so."""
    with cp.Loader(_parallel(fn), _cfg(2)) as loader, pytest.raises(cp.WorkerError, match=text):
        collect(loader)


@pytest.mark.parametrize(
    ("build", "text"),
    [
        pytest.param(
            lambda p: p.map(_many, batched="yes", parallel=True), "must be a bool", id="not-bool"
        ),
        pytest.param(
            lambda p: p.map(_many, batched=True, parallel=True, with_rng=True),
            "do not go together",
            id="with-rng",
        ),
        pytest.param(lambda p: p.map(_many, batched=True), "parallel=True", id="inline-central"),
    ],
)
def test_bad_batched_options_are_refused_at_build(build: Any, text: str) -> None:
    """batched must be a bool, without with_rng, on a map that runs in the workers."""
    with pytest.raises(cp.PipelineError, match=text):
        build(cp.Pipeline.from_iterable(range(3)))


@pytest.mark.parametrize(("before", "after"), [(2, 0), (0, 3)], ids=["2w-to-0w", "0w-to-3w"])
def test_resumes_exactly_at_every_k(before: int, after: int) -> None:
    """A batched parallel map's checkpoints resume exactly at every k."""
    pipe = _parallel(_many, 24).batch(3)
    assert_resumes_exactly(pipe, _cfg(before), resume_config=_cfg(after))
