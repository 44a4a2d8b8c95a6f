"""Parallel central maps: run in the workers, re-enter the central chain in order."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import centralpipe as cp
from centralpipe.testing import assert_resumes_exactly
from tests.fns import faulty

N = 40
EXECUTORS = ["process", "thread"]
CONFIGS = [
    pytest.param(w, ex, id=f"{w}w-{ex}")
    for w, ex in [*((w, "process") for w in range(4)), *((w, "thread") for w in (1, 2, 3))]
]


def _cfg(
    workers: int = 2, executor: str = "process", *, chunk_size: int | None = 3, **kw: Any
) -> cp.LoaderConfig:
    kw.setdefault("buffer_size", 8)
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(
            num_workers=workers,
            executor=executor,
            start_method="fork",
            chunk_size=chunk_size,
            **kw,
        ),
        seed=7,
    )


def _square(x: int) -> int:
    return x * x


def _odd(x: int) -> bool:
    return x % 2 == 1


def _repeat(x: int) -> list[int]:
    return [x] * (x % 3)


def _noise(x: int, rng: torch.Generator) -> tuple[int, int]:
    return x, int(torch.randint(0, 1000, (1,), generator=rng))


def _one_segment(n: int = N) -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(range(n))
        .shuffle(5)
        .map(_noise, parallel=True, with_rng=True, name="noisy")
        .count("seen")
        .batch(3)
        .dispatch()
        .map(len)
    )


def _two_segments(n: int = N) -> cp.Pipeline:
    """parallel flat_map → central filter → parallel map, no dispatch()."""
    return (
        cp.Pipeline.from_iterable(range(n))
        .count("before")
        .flat_map(_repeat, parallel=True, name="repeat")
        .filter(_odd)
        .map(_square, parallel=True, name="square")
        .count("after")
    )


def _inline(pipe: cp.Pipeline) -> cp.Pipeline:
    """The same pipeline with every stage run inline."""
    specs = tuple(
        type(s)(
            s.kind,
            s.name,
            s.placement,
            s.fn,
            {k: v for k, v in s.options.items() if k != "parallel"},
        )
        for s in pipe.stages
    )
    return cp.Pipeline(specs)


def _run(pipe: cp.Pipeline, cfg: cp.LoaderConfig, epochs: int = 1) -> list[Any]:
    with cp.Loader(pipe, cfg) as loader:
        return [x for _ in range(epochs) for x in loader]


@pytest.mark.parametrize(("workers", "executor"), CONFIGS)
@pytest.mark.parametrize("build", [_one_segment, _two_segments], ids=["one", "two"])
def test_output_is_the_same_for_every_worker_count_and_executor(
    build: Any, workers: int, executor: str
) -> None:
    """Parallel stages give the inline output, whatever the workers and executor."""
    pipe = build()
    expected = _run(pipe, _cfg(0), 2)
    assert _run(pipe, _cfg(workers, executor), 2) == expected


def test_parallel_output_equals_inline_output() -> None:
    """A pipeline gives the same items with parallel=True as with the stages inline."""
    pipe = _two_segments()
    assert _run(pipe, _cfg(2)) == _run(_inline(pipe), _cfg(2))


def test_with_rng_depends_on_position_not_on_workers() -> None:
    """with_rng on a parallel map: same numbers for 0 and 3 workers, new each epoch."""
    pipe = cp.Pipeline.from_iterable(range(20)).map(_noise, parallel=True, with_rng=True)
    a = _run(pipe, _cfg(0), 2)
    b = _run(pipe, _cfg(3, chunk_size=2), 2)
    assert a == b
    assert [r for _, r in a[:20]] != [r for _, r in a[20:]]


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ((0, "process"), (2, "process")),
        ((2, "process"), (3, "thread")),
        ((2, "thread"), (1, "process")),
    ],
    ids=["0to2", "2to3thread", "thread2to1"],
)
@pytest.mark.parametrize("build", [_one_segment, _two_segments], ids=["one", "two"])
def test_resumes_exactly_at_every_k_across_workers_and_executors(
    build: Any, before: tuple[int, str], after: tuple[int, str]
) -> None:
    """A checkpoint at any k resumes exactly with another worker count or executor."""
    assert_resumes_exactly(build(24), _cfg(*before), resume_config=_cfg(*after), epochs=2)


@pytest.mark.parametrize("workers", [0, 2])
def test_delivered_counts_equal_the_inline_run(workers: int) -> None:
    """query(delivered=True) before and after parallel stages is what the inline run
    shows after the same number of items."""
    pipe = _two_segments(30)

    def trace(p: cp.Pipeline, cfg: cp.LoaderConfig) -> list[tuple[Any, ...]]:
        out = []
        with cp.Loader(p, cfg) as loader:
            for x in loader:
                out.append(
                    (
                        x,
                        loader.query("before", delivered=True),
                        loader.query("after", delivered=True),
                    )
                )
        return out

    assert trace(pipe, _cfg(workers)) == trace(_inline(pipe), _cfg(0))


def test_central_state_and_checkpoint_central_part_equal_inline() -> None:
    """Between items, the central states (besides in-flight inputs) equal the inline run's
    once the buffers are drained: at the end of the epoch."""
    pipe = _two_segments(25)
    with cp.Loader(pipe, _cfg(2)) as a, cp.Loader(_inline(pipe), _cfg(0)) as b:
        list(a)
        list(b)
        sa, sb = a.state_dict(), b.state_dict()
    assert sa["central"]["before"] == sb["central"]["before"]
    assert sa["central"]["after"] == sb["central"]["after"]
    assert sa["in_flight"]["square"]["items"] == []


def test_checkpoint_holds_each_parallel_stage_in_flight_inputs() -> None:
    """Mid-epoch the checkpoint has in-flight inputs per parallel stage, by name."""
    pipe = _two_segments(200)
    with cp.Loader(pipe, _cfg(2, buffer_size=16)) as loader:
        it = iter(loader)
        for _ in range(5):
            next(it)
        sd = loader.state_dict()
    assert set(sd["in_flight"]) - {"dispatch"} == {"repeat", "square"}
    assert any(sd["in_flight"][n]["items"] for n in ("repeat", "square"))


def test_parallel_after_dispatch_is_a_pipeline_error() -> None:
    """parallel=True after dispatch() names the stage and says why."""
    pipe = cp.Pipeline.from_iterable(range(3)).dispatch()
    with pytest.raises(cp.PipelineError, match=r"'map_2'.*parallel=True.*before dispatch"):
        pipe.map(_square, parallel=True)
    with pytest.raises(cp.PipelineError, match="parallel=True"):
        pipe.filter(_odd, parallel=True)


def test_bad_parallel_and_with_rng_values() -> None:
    """parallel must be a bool; with_rng on an inline central map points to parallel=True."""
    pipe = cp.Pipeline.from_iterable(range(3))
    with pytest.raises(cp.PipelineError, match="`parallel` must be a bool"):
        pipe.map(_square, parallel="yes")  # type: ignore[arg-type]
    with pytest.raises(cp.PipelineError, match="pass parallel=True"):
        pipe.map(_noise, with_rng=True)


def test_executor_must_be_process_or_thread() -> None:
    """WorkerConfig(executor=...) accepts only 'process' and 'thread'."""
    with pytest.raises(cp.ConfigError, match="executor"):
        cp.WorkerConfig(executor="gpu")


def test_inline_checkpoint_is_refused_by_a_parallel_pipeline() -> None:
    """A checkpoint taken with the stages inline does not silently resume them in parallel."""
    pipe = _two_segments()
    with cp.Loader(_inline(pipe), _cfg(0)) as loader:
        next(iter(loader))
        sd = loader.state_dict()
    with (
        cp.Loader(pipe, _cfg(0)) as loader,
        pytest.raises(
            cp.CheckpointError,
            match=r"stage 'repeat' ran in the main process .* and is parallel=True now",
        ),
    ):
        loader.load_state_dict(sd)


def test_damaged_segment_entry_is_refused() -> None:
    """A damaged parallel-stage entry is a CheckpointError naming the stage."""
    pipe = _two_segments()
    with cp.Loader(pipe, _cfg(0)) as loader:
        next(iter(loader))
        sd = loader.state_dict()
        flights = sd["in_flight"]
        bad = {**sd, "in_flight": {**flights, "square": {**flights["square"], "next_seq": "x"}}}
        with pytest.raises(cp.CheckpointError, match="in_flight\\['square'\\]"):
            loader.load_state_dict(bad)


# -- faults ------------------------------------------------------------------------------


def _fault_pipe(fn: Any, n: int = 60) -> cp.Pipeline:
    return cp.Pipeline.from_iterable(range(n)).map(fn, parallel=True, name="work").count("c")


def test_killed_worker_in_a_parallel_stage_is_replaced(tmp_path: Path) -> None:
    """A worker killed while running a parallel stage: replaced, re-sent, exact output."""
    fn = functools.partial(faulty.kill_once, at=23, marker=str(tmp_path / "m"))
    with cp.Loader(_fault_pipe(fn), _cfg(2)) as loader:
        assert list(loader) == list(range(60))
        assert loader.metrics()["dispatch"]["restarts"] == 1


def test_poison_item_in_a_parallel_stage_is_reported_after_the_items_before_it() -> None:
    """An item that kills every worker: items before it delivered, then WorkerError."""
    fn = functools.partial(faulty.segfault_always, at=31)
    out: list[int] = []
    with cp.Loader(_fault_pipe(fn), _cfg(2)) as loader, pytest.raises(cp.WorkerError) as info:
        for x in loader:
            out.append(x)
    assert out == list(range(31))
    assert info.value.seq == 31
    assert info.value.stage == "work"


@pytest.mark.parametrize("executor", EXECUTORS)
def test_hung_parallel_item(tmp_path: Path, executor: str) -> None:
    """timeout_s: a hung process is killed and the item retried; a hung thread is
    reported (threads cannot be stopped), after the items before it."""
    if executor == "process":
        fn: Any = functools.partial(faulty.hang_once, at=20, marker=str(tmp_path / "m"))
        with cp.Loader(_fault_pipe(fn), _cfg(2, timeout_s=0.5)) as loader:
            assert list(loader) == list(range(60))
        return
    fn = functools.partial(faulty.hang_interruptible, at=20, release=str(tmp_path / "go"))
    out: list[int] = []
    try:
        with (
            cp.Loader(_fault_pipe(fn), _cfg(2, "thread", timeout_s=0.3)) as loader,
            pytest.raises(cp.WorkerError, match="hung") as info,
        ):
            for x in loader:
                out.append(x)
    finally:
        (tmp_path / "go").touch()
    assert out == list(range(20))
    assert info.value.seq == 20 and info.value.stage == "work"


@pytest.mark.parametrize(("workers", "executor"), [(0, "process"), (2, "process"), (2, "thread")])
def test_raising_parallel_stage(workers: int, executor: str) -> None:
    """An exception in a parallel stage is a WorkerError naming it, after the items
    before it; with on_error='skip' the item is skipped and counted."""
    fn = functools.partial(faulty.raise_at, at=frozenset({17}))
    out: list[int] = []
    with (
        cp.Loader(_fault_pipe(fn), _cfg(workers, executor)) as loader,
        pytest.raises(cp.WorkerError) as info,
    ):
        for x in loader:
            out.append(x)
    assert out == list(range(17))
    assert (info.value.stage, info.value.seq) == ("work", 17)
    assert "BadValue" in str(info.value)
    with cp.Loader(_fault_pipe(fn), _cfg(workers, executor, on_error="skip")) as loader:
        assert list(loader) == [x for x in range(60) if x != 17]
        assert loader.metrics()["dispatch"]["skipped"] == 1
        assert loader.query("c") == {"items": 59, "weight": 59}


def test_poison_item_skipped_in_a_parallel_stage() -> None:
    """on_error='skip': an item that kills every worker is skipped; the rest is exact."""
    fn = functools.partial(faulty.segfault_always, at=12)
    with cp.Loader(_fault_pipe(fn), _cfg(2, on_error="skip")) as loader:
        assert list(loader) == [x for x in range(60) if x != 12]


def test_checkpoint_after_a_parallel_failure_retries_the_item() -> None:
    """After a WorkerError from a parallel stage, the checkpoint resumes at that item."""
    fn = functools.partial(faulty.raise_at, at=frozenset({9}))
    with cp.Loader(_fault_pipe(fn), _cfg(2)) as loader:
        with pytest.raises(cp.WorkerError):
            list(loader)
        sd = loader.state_dict()
    with cp.Loader(_fault_pipe(faulty.identity), _cfg(2)) as loader:
        loader.load_state_dict(sd)
        assert list(loader) == list(range(9, 60))


def test_parallel_inside_a_mix_sub_pipeline_is_refused() -> None:
    """A parallel stage inside a mix() sub-pipeline is a PipelineError naming it."""
    inner = cp.Pipeline.from_iterable(range(4)).map(_square, parallel=True, name="sq")
    other = cp.Pipeline.from_iterable(range(4))
    with pytest.raises(cp.PipelineError, match=r"'sq' \(map, parallel\)"):
        cp.Pipeline.mix({"a": inner, "b": other}, weights={"a": 1, "b": 1})


def _plus_one(x: int) -> int:
    return x + 1


@pytest.mark.parametrize(
    ("saved_parallel", "now_parallel", "says"),
    [
        (True, False, "ran in worker processes (parallel=True) when the checkpoint was taken"),
        (False, True, "ran in the main process when the checkpoint was taken, and is parallel"),
    ],
    ids=["parallel-then-not", "not-then-parallel"],
)
def test_a_checkpoint_from_another_parallel_option_says_the_pipeline_differs(
    saved_parallel: bool, now_parallel: bool, says: str
) -> None:
    """Loading a checkpoint into the same stages with another ``parallel=`` is a
    CheckpointError that names the stage and the option, not "damaged"."""

    def pipe(parallel: bool) -> cp.Pipeline:
        return cp.Pipeline.from_iterable(range(20)).map(_plus_one, parallel=parallel).dispatch()

    config = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=2, start_method="fork"))
    with cp.Loader(pipe(saved_parallel), config) as loader:
        it = iter(loader)
        assert [next(it) for _ in range(3)] == [1, 2, 3]
        state = loader.state_dict()
    with cp.Loader(pipe(now_parallel), config) as loader, pytest.raises(cp.CheckpointError) as info:
        loader.load_state_dict(state)
    text = str(info.value)
    assert "different pipeline" in text and "stage 'map_1'" in text and says in text
    assert "damaged" not in text
