"""An inline ``map`` pulled in bulk (by a bucket, a batch or a chunk) pulls its
own inputs in bulk, and stays exact."""

from __future__ import annotations

from typing import Any

import pytest

import centralpipe as cp
from centralpipe.stages.transform import MAP_BULK
from centralpipe.testing import assert_resumes_exactly
from tests.support.configs import loader_config

pytestmark = pytest.mark.timeout(120)


def times3(x: int) -> int:
    return 3 * x


def fails_at_5(x: int) -> int:
    if x == 5:
        raise ValueError("five")
    return x


def length(xs: list[int]) -> int:
    return len(xs)


def repeat(x: int) -> list[int]:
    return [x] * (1 + x % 7)


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "2workers"])
def test_a_map_under_a_bucket_resumes_exactly_at_every_k(workers: int) -> None:
    """A map whose bucket pulls 64 inputs at a time: first k + resumed rest
    equals the uninterrupted run, at every k, over two epochs."""
    pipe = (
        cp.Pipeline.from_iterable(range(150))
        .map(repeat)
        .bucket_by_max_tokens(20, len_fn=length, buffer_size=30)
        .dispatch()
        .map(length)
    )
    assert_resumes_exactly(pipe, loader_config(num_workers=workers, chunk_size=3), epochs=2)


def test_a_map_feeding_a_chunked_boundary_resumes_exactly() -> None:
    """The dispatch boundary pulls chunks from the map: exact at every k, and
    the output is the map's, in order."""
    pipe = cp.Pipeline.from_iterable(range(300)).map(times3).dispatch().map(str)
    full = assert_resumes_exactly(pipe, loader_config(num_workers=2, chunk_size=50))
    assert full == [str(3 * i) for i in range(300)]


def test_a_failing_input_in_a_bulk_pull_consumes_only_itself() -> None:
    """The inputs pulled with a failing one stay held (saved in the state), and
    the pass resumes after the failing input with them first."""
    pipe = cp.Pipeline.from_iterable(range(22)).map(fails_at_5).batch(4).dispatch()
    with cp.Loader[Any](pipe, loader_config()) as loader:
        it = iter(loader)
        assert next(it) == [0, 1, 2, 3]
        with pytest.raises(ValueError, match="five") as info:
            next(it)
        assert any("map_1" in note for note in getattr(info.value, "__notes__", []))
        state = loader.state_dict()
    assert state["central"]["map_1"]["held"] == [6, 7]
    kept = [x for x in range(4, 22) if x != 5]
    with cp.Loader[Any](pipe, loader_config()) as loader:
        loader.load_state_dict(state)
        assert list(loader) == [kept[i : i + 4] for i in range(0, len(kept), 4)]


def test_a_state_holding_a_bulk_of_inputs_loads() -> None:
    """A checkpoint whose map holds MAP_BULK inputs (a failure at the first of a
    bulk pull) is valid: they are mapped before the source's next inputs."""
    pipe = cp.Pipeline.from_iterable(range(10)).map(times3).dispatch()
    config = loader_config(chunk_size=1)
    with cp.Loader[Any](pipe, config) as loader:
        it = iter(loader)
        assert next(it) == 0
        state = loader.state_dict()
        assert state["central"]["map_1"].get("held", []) == []
    held = list(range(100, 100 + MAP_BULK))
    state["central"]["map_1"]["held"] = held
    with cp.Loader[Any](pipe, config) as loader:
        loader.load_state_dict(state)
        out = list(loader)
    assert out == [3 * x for x in [*held, *range(1, 10)]]
