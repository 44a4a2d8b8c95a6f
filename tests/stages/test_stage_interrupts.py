"""Ctrl-C (KeyboardInterrupt) inside a central stage's call: at a nested
``next()`` of its source, or in its own function. When the central chain runs
in the caller's thread (no workers, or no worker stages after ``dispatch()``)
the interrupt reaches the stages themselves; each keeps what it had pulled in
its state, so nothing is lost or repeated. Injected deterministically: a
function of the pipeline raises on its k-th call."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.stages import RunContext, build_central
from centralpipe.stages import files as files_stage
from centralpipe.stages.mix import Mix
from centralpipe.stages.transform import MAP_BULK
from centralpipe.testing import items_until_interrupt
from tests.support.configs import loader_config

N = 60


class Trip:
    """``fn``, except that its ``k``-th call raises KeyboardInterrupt (once);
    ``k=None``: never."""

    def __init__(self, fn: Callable[..., Any], k: int | None) -> None:
        self.fn = fn
        self.k = k
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls == self.k:
            raise KeyboardInterrupt(f"injected at call {self.k}")
        return self.fn(*args)


class HalfwayTrip:
    """A flat_map function whose ``k``-th output generator raises
    KeyboardInterrupt after its first output (a generator cut short)."""

    def __init__(self, k: int | None) -> None:
        self.k = k
        self.calls = 0

    def __call__(self, x: int) -> Iterator[int]:
        self.calls += 1
        yield x
        if self.calls == self.k:
            raise KeyboardInterrupt(f"injected in call {self.k}")
        yield 1000 + x


def _same(x: Any) -> Any:
    return x


def _inc(x: int) -> int:
    return x + 1


def _odd(x: int) -> bool:
    return x % 2 == 1


def _two(x: int) -> list[int]:
    return [x, 1000 + x]


def _len(x: int) -> int:
    return x % 7 + 1


def _src(parallel: bool) -> cp.Pipeline:
    p = cp.Pipeline.from_iterable(range(N))
    return p.map(_inc, parallel=True, name="par") if parallel else p


def _gen_source(k: int | None) -> cp.Pipeline:
    trip = Trip(_same, k)

    def items() -> Iterator[int]:
        for i in range(N):
            yield trip(i)

    return cp.Pipeline.from_iterable(items)


def _mix(k: int | None, stop: str, parallel: bool) -> cp.Pipeline:
    a = cp.Pipeline.from_iterable(range(0, 12)).map(Trip(_same, k), name="trip")
    b = cp.Pipeline.from_iterable(range(100, 140)).shuffle(5)
    p = cp.Pipeline.mix({"a": a, "b": b}, weights={"a": 0.5, "b": 0.5}, stop=stop)
    if parallel:
        p = p.map(_same, parallel=True, name="par")
    return p


#: name -> (pipeline of the trip's k and whether a parallel map runs on the
#: workers first, the k's to interrupt at). Each k lands inside a group,
#: buffer or pass being gathered: what the old code lost.
CASES: dict[str, tuple[Callable[[int | None, bool], cp.Pipeline], list[int]]] = {
    "batch-nested-next": (lambda k, par: _src(par).map(Trip(_same, k)).batch(4), [1, 6, 23]),
    "batch-drop-last": (
        lambda k, par: _src(par).map(Trip(_same, k)).batch(7, drop_last=True),
        [3, 40],
    ),
    "map-fn": (lambda k, par: _src(par).map(Trip(_inc, k)).batch(3), [1, 5]),
    "filter-pred": (lambda k, par: _src(par).filter(Trip(_odd, k)).batch(3), [2, 9]),
    "flat_map-fn": (lambda k, par: _src(par).flat_map(Trip(_two, k)).batch(3), [4]),
    "flat_map-generator": (lambda k, par: _src(par).flat_map(HalfwayTrip(k)).batch(3), [4]),
    "count-weight_fn": (
        lambda k, par: _src(par).count("c", weight_fn=Trip(_len, k)).batch(5),
        [3, 12],
    ),
    "bucket-len_fn": (
        lambda k, par: _src(par).bucket_by_max_tokens(12, len_fn=Trip(_len, k), buffer_size=6),
        [4, 11],
    ),
    "bucket-nested-next": (
        lambda k, par: (
            _src(par).map(Trip(_same, k)).bucket_by_max_tokens(12, len_fn=_len, buffer_size=6)
        ),
        [4, 11],
    ),
    "pack-first_fit": (
        lambda k, par: _src(par).pack(10, len_fn=Trip(_len, k), strategy="first_fit"),
        [3, 17],
    ),
    "pack-best_fit": (
        lambda k, par: _src(par).map(Trip(_same, k)).pack(10, len_fn=_len, strategy="best_fit"),
        [3, 17],
    ),
    "shuffle-nested-next": (lambda k, par: _src(par).map(Trip(_same, k)).shuffle(8), [5, 9]),
    "shard-counted": (
        lambda k, par: _src(par).map(Trip(_same, k)).count("c").shard().batch(2),
        [7],
    ),
    "shard-equalize": (
        lambda k, par: _src(par).count("c").map(Trip(_same, k)).shard(equalize="pad"),
        [6, 59],
    ),
    "source-generator": (
        lambda k, par: _gen_source(k).map(_inc, parallel=True) if par else _gen_source(k),
        [5],
    ),
    "mix-all_exhausted": (lambda k, par: _mix(k, "all_exhausted", par), [3, 8]),
    "mix-never": (lambda k, par: _mix(k, "never", par), [13]),
}
PARAMS = [pytest.param(name, k, id=f"{name}-k{k}") for name, (_, ks) in CASES.items() for k in ks]
SHARDED = {"shard-counted", "shard-equalize"}
#: Endless epochs (mix with stop="never") are compared over their first items.
LIMIT = {"mix-never": 90}


def _config(name: str, workers: int) -> cp.LoaderConfig:
    ws = 2 if name in SHARDED else 1
    return loader_config(num_workers=workers, buffer_size=16, chunk_size=4, world_size=ws)


def _take(it: Any, n: int | None) -> list[Any]:
    """The items of ``it`` (an iterable), at most ``n`` of them."""
    return list(itertools.islice(it, n))


def _expected(name: str, parallel: bool) -> list[Any]:
    make = CASES[name][0]
    with cp.Loader(make(None, parallel), _config(name, 0)) as loader:
        return _take(loader, LIMIT.get(name))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("name", "k"), PARAMS)
def test_interrupt_in_a_stage_loses_nothing(name: str, k: int, workers: int) -> None:
    """Ctrl-C inside a central stage's call: the same iterator goes on, and the
    checkpoint taken then, loaded into the same loader or a fresh one, gives
    exactly the rest of the epoch; with 2 workers a parallel map runs on them
    first."""
    make = CASES[name][0]
    parallel = workers > 0
    expected = _expected(name, parallel)
    rest = LIMIT.get(name)
    config = _config(name, workers)
    with cp.Loader(make(k, parallel), config) as loader:
        it = iter(loader)
        got = items_until_interrupt(it)
        sd = loader.state_dict()
        assert sd["finished"] is False
        if rest is not None:
            rest -= len(got)
        assert got + _take(it, rest) == expected  # the same iterator goes on
        loader.load_state_dict(sd)
        again = _take(loader, rest)
    assert got + again == expected
    with cp.Loader(make(None, parallel), config) as fresh:
        fresh.load_state_dict(sd)
        assert got + _take(fresh, rest) == expected


def _chain(pipe: cp.Pipeline) -> list[Any]:
    nodes = build_central(pipe.central_stages, RunContext(seed=0, epoch=1))
    for node in nodes:
        node.prepare()
    nodes[-1].load_flat(None)
    return nodes


def _drain(tip: Any, n: int | None = None) -> list[Any]:
    out: list[Any] = []
    while n is None or len(out) < n:
        try:
            out.append(next(tip))
        except StopIteration:
            break
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "k"), [p for p in PARAMS if p.values[0] not in SHARDED])
def test_the_chain_goes_on_after_an_interrupt(name: str, k: int) -> None:
    """After Ctrl-C inside a stage's call, the next ``next()`` of the chain goes
    on where it was, and the stages' states taken at the interrupt resume a
    fresh chain at the same point."""
    make = CASES[name][0]
    limit = LIMIT.get(name)
    expected = _drain(_chain(make(None, False))[-1], limit)
    nodes = _chain(make(k, False))
    tip = nodes[-1]
    got: list[Any] = []
    with pytest.raises(KeyboardInterrupt):
        while True:
            got.append(next(tip))
    states = {node.name: node.own_state() for node in nodes}
    rest = None if limit is None else limit - len(got)
    assert got + _drain(tip, rest) == expected
    fresh = _chain(make(None, False))
    fresh[-1].load_flat(states)
    assert got + _drain(fresh[-1], rest) == expected


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_interrupt_while_read_lines_opens_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """Ctrl-C while read_lines opens its next file: the file stays the stage's
    (its path at offset 0), so neither the checkpoint nor the pass skips it."""
    for i in range(4):
        (tmp_path / f"{i}.txt").write_text("".join(f"{i}-{j}\n" for j in range(5)))

    def pipe() -> cp.Pipeline:
        p = cp.Pipeline.from_files(str(tmp_path / "*.txt")).read_lines()
        return p.map(_same, parallel=True) if workers else p

    config = loader_config(num_workers=workers, buffer_size=8, chunk_size=2)
    with cp.Loader(pipe(), config) as loader:
        expected = list(loader)
    monkeypatch.setattr(files_stage, "open", Trip(open, 3), raising=False)  # the third file
    with cp.Loader(pipe(), config) as loader:
        it = iter(loader)
        got = items_until_interrupt(it)
        sd = loader.state_dict()
        assert sd["central"]["read_lines_1"]["path"] == "2.txt"
        assert got + list(it) == expected
        loader.load_state_dict(sd)
        assert got + list(loader) == expected
    with cp.Loader(pipe(), config) as fresh:
        fresh.load_state_dict(sd)
        assert got + list(fresh) == expected


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_interrupt_while_mix_starts_a_pass(monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    """Ctrl-C while a mix with stop='never' starts a source's next pass: the
    draw and the restart stand, so the sampler and the source's passes (and
    their shuffles) are those of an uninterrupted run."""
    real = Mix._start_source
    fired: list[int] = []

    def start(self: Mix, i: int, flat: Any, p: int | None = None) -> None:
        if p is not None and p == 2 and not fired:  # the second restart of a source
            fired.append(i)
            raise KeyboardInterrupt("injected while a pass starts")
        real(self, i, flat, p)

    config = loader_config(num_workers=workers, buffer_size=8, chunk_size=2)
    expected = _expected("mix-never", workers > 0)
    monkeypatch.setattr(Mix, "_start_source", start)
    with cp.Loader(_mix(None, "never", workers > 0), config) as loader:
        it = iter(loader)
        got = items_until_interrupt(it)
        sd = loader.state_dict()
        assert sd["central"]["mix"]["restart"] is True
        rest = LIMIT["mix-never"] - len(got)
        assert got + _take(it, rest) == expected
        loader.load_state_dict(sd)
        assert got + _take(loader, rest) == expected
    assert fired
    with cp.Loader(_mix(None, "never", workers > 0), config) as fresh:
        fresh.load_state_dict(sd)
        assert got + _take(fresh, rest) == expected


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("pipe", "stage", "held"),
    [
        pytest.param(
            cp.Pipeline.from_iterable(range(9)).batch(3), "batch_1", [1, 2, 3, 4], id="batch"
        ),
        pytest.param(
            cp.Pipeline.from_iterable(range(9)).map(_inc),
            "map_1",
            list(range(MAP_BULK + 1)),
            id="map-more-than-a-bulk-pull",
        ),
        pytest.param(
            cp.Pipeline.from_iterable(range(9)).count("c"), "c", [4, 5], id="count-no-weight_fn"
        ),
    ],
)
def test_a_held_input_the_stage_cannot_have_is_refused(
    pipe: cp.Pipeline, stage: str, held: list[Any]
) -> None:
    """A checkpoint whose stage holds more inputs than one interrupted call of
    that stage can pull is damaged: CheckpointError naming the key."""
    with cp.Loader(pipe, loader_config()) as loader:
        sd = loader.state_dict()
        sd["central"][stage]["held"] = held
        with pytest.raises(cp.CheckpointError, match=rf"central\['{stage}'\]\.held"):
            loader.load_state_dict(sd)
        sd["central"][stage]["held"] = "x"
        with pytest.raises(cp.CheckpointError, match="held must be a list"):
            loader.load_state_dict(sd)
