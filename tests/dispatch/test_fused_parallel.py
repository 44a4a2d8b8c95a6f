"""Consecutive parallel stages fused into one round trip
(``WorkerConfig.fuse_parallel``, ``dispatch.segments``).

Every test compares fused against unfused (and, where there is one, against
one stage running the combined function): same outputs, queries, errors and
checkpoints, which resume whichever way they were taken.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.testing import assert_resumes_exactly
from tests.fns import faulty
from tests.fns import fused as f

N = 40
PROCESS_AND_THREAD = [
    pytest.param(w, ex, id=f"{w}w-{ex}")
    for w, ex in [*((w, "process") for w in range(4)), *((w, "thread") for w in (1, 3))]
]


def _cfg(
    workers: int = 2, executor: str = "process", *, fuse: bool = True, **kw: Any
) -> cp.LoaderConfig:
    kw.setdefault("buffer_size", 8)
    kw.setdefault("chunk_size", 3)
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(
            num_workers=workers,
            executor=executor,
            start_method="fork",
            fuse_parallel=fuse,
            **kw,
        ),
        seed=5,
    )


def _mixed(n: int = N) -> cp.Pipeline:
    """map → filter → map → flat_map, all parallel: the first three fused
    (a flat_map keeps its own stream)."""
    return (
        cp.Pipeline.from_iterable(range(n))
        .map(f.double, parallel=True)
        .filter(f.not_div3, parallel=True)
        .map(f.plus_one, parallel=True)
        .flat_map(f.pair, parallel=True)
        .count("seen")
    )


MIXED = [y for x in range(N) if (2 * x) % 3 != 0 for y in (2 * x + 1, -(2 * x + 1))]


def _run(pipe: cp.Pipeline, config: cp.LoaderConfig) -> tuple[list[Any], Any]:
    with cp.Loader(pipe, config) as loader:
        out = list(loader)
        return out, loader.query("seen")


@pytest.mark.parametrize(("workers", "executor"), PROCESS_AND_THREAD)
def test_fused_unfused_and_combined_give_the_same_outputs(workers: int, executor: str) -> None:
    """Two parallel maps in a row give the outputs of one map of the combined
    function, fused or not; so does a map → filter → map → flat_map segment."""
    two = cp.Pipeline.from_iterable(range(N)).map(f.double, parallel=True)
    two = two.map(f.plus_one, parallel=True).count("seen")
    one = cp.Pipeline.from_iterable(range(N)).map(f.double_plus_one, parallel=True).count("seen")
    expected = [2 * x + 1 for x in range(N)]
    assert _run(one, _cfg(workers, executor)) == (expected, {"items": N, "weight": N})
    for fuse in (True, False):
        assert _run(two, _cfg(workers, executor, fuse=fuse)) == (
            expected,
            {"items": N, "weight": N},
        ), fuse
        out, seen = _run(_mixed(), _cfg(workers, executor, fuse=fuse))
        assert out == MIXED and seen["items"] == len(MIXED), fuse


def test_fused_segment_is_one_stream() -> None:
    """Fused, the segment's inputs go out once (its first stage's stream);
    unfused, each stage has its own."""
    for fuse, later in ((True, 0), (False, N)):
        pipe = cp.Pipeline.from_iterable(range(N)).map(f.double, parallel=True, name="a")
        pipe = pipe.map(f.plus_one, parallel=True, name="b")
        with cp.Loader(pipe, _cfg(2, fuse=fuse)) as loader:
            assert list(loader) == [2 * x + 1 for x in range(N)]
            per_worker = loader.metrics()["b"]["parallel"]["items_per_worker"]
        assert sum(per_worker) == later, fuse


def test_metrics_of_a_fused_stage_say_unknown_not_zero() -> None:
    """A stage fused into the next is never pulled: its ``items_out`` (and
    the next stage's ``items_in``) is None, never a wrong 0; unfused, both are
    counted. The segment's last stage counts its outputs either way."""
    for fuse, inner in ((True, None), (False, N)):
        pipe = cp.Pipeline.from_iterable(range(N)).map(f.double, parallel=True, name="a")
        pipe = pipe.filter(f.not_div3, parallel=True, name="b").count("seen")
        with cp.Loader(pipe, _cfg(2, fuse=fuse)) as loader:
            out = list(loader)
            m = loader.metrics()
        kept = len(out)
        assert (m["a"]["items_in"], m["a"]["items_out"]) == (N, inner), fuse
        assert (m["b"]["items_in"], m["b"]["items_out"]) == (inner, kept), fuse
        assert m["seen"]["items_in"] == kept


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize(("workers", "executor"), PROCESS_AND_THREAD)
def test_resumes_exactly_at_every_k(workers: int, executor: str, fuse: bool) -> None:
    """A checkpoint at every k resumes exactly, fused and unfused."""
    assert_resumes_exactly(_mixed(12), _cfg(workers, executor, fuse=fuse))


CROSS = [
    pytest.param(a, b, id=f"{a[0]}w-{a[1]}-to-{b[0]}w-{b[1]}")
    for a, b in [
        ((0, "process"), (2, "process")),
        ((2, "process"), (3, "process")),
        ((3, "process"), (1, "thread")),
        ((2, "thread"), (0, "process")),
    ]
]


@pytest.mark.parametrize(("saved", "loaded"), CROSS)
@pytest.mark.parametrize("fuse_saved", [True, False], ids=["fused-to-unfused", "unfused-to-fused"])
def test_state_saved_one_way_resumes_the_other(
    saved: tuple[int, str], loaded: tuple[int, str], fuse_saved: bool
) -> None:
    """A state saved fused resumes unfused and the reverse, across worker
    counts and executors, into the next epoch (which fuses again)."""
    assert_resumes_exactly(
        _mixed(10),
        _cfg(*saved, fuse=fuse_saved),
        resume_config=_cfg(*loaded, fuse=not fuse_saved),
        epochs=2,
        ks=range(0, 25, 2),
    )


CORPUS: dict[str, bytes] = {
    "a_empty.txt": b"",
    "b_lf.txt": b"one two\nthree\n\nfour five six\n",
    "c_crlf.txt": b"caf\xc3\xa9 au\r\n\r\nx y\r\n",
    "d_no_final_newline.txt": b"".join(b"line %d\n" % i for i in range(17)) + b"tail end",
}


def _lines_pipe(glob: str, *, combined: bool) -> cp.Pipeline:
    lines = cp.Pipeline.from_files(glob).read_lines(name="lines")
    if combined:
        return lines.map(f.tok_lengths, parallel=True).count("seen", weight_fn=len)
    out = lines.map(f.tok, parallel=True).map(f.to_lengths, parallel=True)
    return out.count("seen", weight_fn=len)


@pytest.mark.parametrize(("workers", "executor"), [(0, "process"), (2, "process"), (2, "thread")])
def test_read_lines_into_two_parallel_maps(tmp_path: Path, workers: int, executor: str) -> None:
    """read_lines (LF, CRLF, empty lines and files, no final newline) into two
    parallel maps: the combined map's outputs and query, fused or not, and
    exact resume; fused on workers, the lines are read there."""
    for name, data in CORPUS.items():
        (tmp_path / name).write_bytes(data)
    glob = str(tmp_path / "*.txt")
    expected = _run(_lines_pipe(glob, combined=True), _cfg(0))
    assert len(expected[0]) == 4 + 3 + 18
    for fuse in (True, False):
        config = _cfg(workers, executor, fuse=fuse)
        assert _run(_lines_pipe(glob, combined=False), config) == expected, fuse
    pipe = _lines_pipe(glob, combined=False)
    with cp.Loader(pipe, _cfg(workers, executor)) as loader:
        list(loader)
        read = loader.metrics()["map_2"]["parallel"]["lines_read_in_workers"]
    assert read == (25 if workers else 0)
    assert_resumes_exactly(pipe, _cfg(workers, executor), ks=range(0, 26, 2))


def _failing(n: int = N) -> cp.Pipeline:
    pipe = cp.Pipeline.from_iterable(range(n)).map(f.double, parallel=True)
    return pipe.map(f.fail_on_7, parallel=True, name="second").count("seen")


@pytest.mark.parametrize("workers", [0, 2])
def test_on_error_skip_in_the_second_stage(workers: int) -> None:
    """on_error='skip' drops the item the second stage fails on, fused or
    not, and resumes exactly."""
    expected = [2 * x for x in range(N) if x != 7]
    for fuse in (True, False):
        config = _cfg(workers, fuse=fuse, on_error="skip")
        assert _run(_failing(), config)[0] == expected, fuse
    assert_resumes_exactly(_failing(20), _cfg(workers, on_error="skip"), ks=range(0, 20, 2))


@pytest.mark.parametrize("workers", [0, 2])
def test_error_in_the_second_stage_names_it(workers: int) -> None:
    """A raise in the second stage is a WorkerError naming that stage and the
    same seq fused or not, after every earlier item."""
    seen = []
    for fuse in (True, False):
        out: list[int] = []
        loader = cp.Loader(_failing(), _cfg(workers, fuse=fuse))
        with loader, pytest.raises(cp.WorkerError) as info:
            for x in loader:
                out.append(x)
        assert out == [2 * x for x in range(7)]
        err = info.value
        seen.append((err.stage, err.seq, err.exc_type))
        assert "bad item 14" in str(err)
    assert seen[0] == seen[1] == ("second", 7, "ValueError")


def test_worker_killed_mid_segment_loses_nothing(tmp_path: Path) -> None:
    """A worker killed in the second function of a fused segment is replaced
    and its chunk re-sent: exact output."""
    kill = functools.partial(faulty.kill_once, at=50, marker=str(tmp_path / "m"))
    pipe = cp.Pipeline.from_iterable(range(N)).map(f.double, parallel=True)
    pipe = pipe.map(kill, parallel=True, name="second")
    with cp.Loader(pipe, _cfg(2, start_inline=False)) as loader:
        assert list(loader) == [2 * x for x in range(N)]
        assert loader.metrics()["dispatch"]["restarts"] == 1


def test_with_rng_stage_starts_a_new_segment() -> None:
    """A parallel map with_rng after another is not fused: its random
    stream is keyed by its own inputs, the same with fusing on or off."""
    pipe = cp.Pipeline.from_iterable(range(N)).filter(f.not_div3, parallel=True)
    pipe = pipe.map(f.rng_draw, parallel=True, with_rng=True)
    outs = [_run(pipe.count("seen"), _cfg(2, fuse=fuse))[0] for fuse in (True, False)]
    assert outs[0] == outs[1]
