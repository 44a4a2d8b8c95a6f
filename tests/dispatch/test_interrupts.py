"""Ctrl-C (KeyboardInterrupt) injected at each point of a pass's start: the
supervisor and feeder threads, the workers' check, the parallel stages'
streams, the pin thread. After any of them no thread touches the central
stages, ``close()`` stops everything, and a checkpoint taken afterwards
resumes exactly."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import centralpipe as cp
from centralpipe.dispatch import pinning
from centralpipe.dispatch.executors.pool import Executor
from centralpipe.dispatch.run import Run
from centralpipe.stages import Parallel
from centralpipe.testing import collect
from tests.support.configs import loader_config

N = 1000
RUN_THREADS = ("centralpipe-feeder", "centralpipe-supervisor")


def _times2(x: int) -> int:
    return 2 * x


class Calls:
    """A central map that records which thread ran it, and how often."""

    def __init__(self) -> None:
        self.count = 0
        self.threads: set[str] = set()

    def __call__(self, x: int) -> int:
        self.count += 1
        self.threads.add(threading.current_thread().name)
        return x


def _pipe(kind: str, calls: Calls) -> cp.Pipeline:
    p = cp.Pipeline.from_iterable(range(N)).map(calls).shuffle(200)
    if kind == "feeder":
        return p.count("c").dispatch().map(_times2)
    if kind == "segment":  # a parallel stage, no worker stage: the consumer runs the chain
        return p.map(_times2, parallel=True).count("c").dispatch()
    # both: a parallel stage inside the chain the feeder runs
    return p.map(_times2, parallel=True).count("c").dispatch().map(_times2)


def _config() -> cp.LoaderConfig:
    return loader_config(num_workers=2, buffer_size=64)


_EXPECTED: dict[str, list[list[int]]] = {}


def _expected(kind: str) -> list[list[int]]:
    """Two epochs, uninterrupted (inline: the same output by design)."""
    if kind not in _EXPECTED:
        with cp.Loader(_pipe(kind, Calls()), loader_config(buffer_size=64)) as loader:
            _EXPECTED[kind] = [collect(loader) for _ in range(2)]
    return _EXPECTED[kind]


def _once(exc_after: bool, real: Callable[..., Any]) -> Callable[..., Any]:
    """``real`` wrapped to raise KeyboardInterrupt on its first call, before
    (or after) doing its work."""
    fired: list[int] = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if fired:
            return real(*args, **kwargs)
        fired.append(1)
        if exc_after:
            real(*args, **kwargs)
        raise KeyboardInterrupt

    return wrapper


def _inject_thread_start(monkeypatch: pytest.MonkeyPatch, name: str, after: bool) -> None:
    real = threading.Thread.start
    fired: list[int] = []

    def start(self: threading.Thread) -> None:
        if self.name != name or fired:
            real(self)
            return
        fired.append(1)
        if after:
            real(self)  # the thread runs: Ctrl-C landed in start()'s wait for it
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", start)


def _inject(monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    if point.startswith(("supervisor", "feeder")):
        name, when = point.split("-")
        _inject_thread_start(monkeypatch, f"centralpipe-{name}", when == "after")
    elif point == "ensure-alive":
        monkeypatch.setattr(Executor, "ensure_alive", _once(True, Executor.ensure_alive))
    elif point == "attach":
        monkeypatch.setattr(Parallel, "attach", _once(True, Parallel.attach))
    elif point == "run-started":
        monkeypatch.setattr(Run, "start", _once(True, Run.start))
    else:  # pragma: no cover - a typo in the parameters
        raise AssertionError(point)


def _run_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in RUN_THREADS and t.is_alive()]


POINTS = {
    "feeder": [
        "ensure-alive",
        "supervisor-before",
        "supervisor-after",
        "feeder-before",
        "feeder-after",
        "run-started",
    ],
    "segment": ["ensure-alive", "attach", "supervisor-before", "supervisor-after", "run-started"],
    "both": ["attach", "supervisor-after", "feeder-before", "feeder-after", "run-started"],
}
CASES = [
    pytest.param(kind, point, id=f"{kind}-{point}") for kind in POINTS for point in POINTS[kind]
]


def _interrupted_start(loader: cp.Loader[Any]) -> Iterator[Any]:
    it = iter(loader)
    with pytest.raises(KeyboardInterrupt):
        next(it)
    return it


def _assert_quiet(calls: Calls) -> None:
    """No thread of the run is left, and none calls the central stages."""
    assert _run_threads() == []
    before = calls.count
    time.sleep(0.2)  # a leaked feeder would pull hundreds of items meanwhile
    assert calls.count == before


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("kind", "point"), CASES)
def test_ctrl_c_while_the_next_epoch_starts(
    monkeypatch: pytest.MonkeyPatch, kind: str, point: str
) -> None:
    """Ctrl-C at any point of an epoch's start: nothing runs on, the next
    pass delivers that whole epoch, and its checkpoint resumes it exactly."""
    expected = _expected(kind)
    calls = Calls()
    loader = cp.Loader(_pipe(kind, calls), _config())
    try:
        assert collect(loader) == expected[0]
        _inject(monkeypatch, point)
        _interrupted_start(loader)
        _assert_quiet(calls)
        assert loader.epoch == 1
        sd = loader.state_dict()
        assert collect(loader) == expected[1]
    finally:
        loader.close()
    assert _run_threads() == []
    with cp.Loader(_pipe(kind, Calls()), _config()) as fresh:
        fresh.load_state_dict(sd)
        assert collect(fresh) == expected[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("kind", "point"), CASES)
def test_ctrl_c_while_a_checkpoint_resumes(
    monkeypatch: pytest.MonkeyPatch, kind: str, point: str
) -> None:
    """Ctrl-C while a loaded mid-epoch checkpoint starts: the checkpoint
    stays pending and resumes exactly, with no item lost or repeated."""
    k = 300
    expected = _expected(kind)[0]
    with cp.Loader(_pipe(kind, Calls()), _config()) as first:
        it = iter(first)
        head = [next(it) for _ in range(k)]
        sd = first.state_dict()
    calls = Calls()
    with cp.Loader(_pipe(kind, calls), _config()) as loader:
        loader.load_state_dict(sd)
        _inject(monkeypatch, point)
        _interrupted_start(loader)
        _assert_quiet(calls)
        again = loader.state_dict()
        assert again["epoch"] == sd["epoch"] and again["finished"] is False
        rest = collect(loader)
    assert head + rest == expected
    with cp.Loader(_pipe(kind, Calls()), _config()) as fresh:
        fresh.load_state_dict(again)
        assert head + collect(fresh) == expected


@pytest.mark.timeout(60)
def test_close_after_an_interrupted_start_stops_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """The feeder started but Ctrl-C hit before the pass was handed over:
    close() right away stops it (no later pass needed)."""
    calls = Calls()
    loader = cp.Loader(_pipe("feeder", calls), _config())
    _inject(monkeypatch, "feeder-after")
    _interrupted_start(loader)
    loader.close()
    _assert_quiet(calls)
    assert loader.worker_pids() == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("after", [False, True], ids=["before-start", "after-start"])
def test_ctrl_c_while_the_pin_thread_starts(monkeypatch: pytest.MonkeyPatch, after: bool) -> None:
    """Ctrl-C in the pin thread's start (inline: the consumer starts it): the
    pass goes on with a fresh pin thread, delivers every item once, and
    close() leaves no pin thread."""
    monkeypatch.setattr(pinning, "accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)
    monkeypatch.setattr(pinning, "pin", lambda obj: obj)
    pipe = cp.Pipeline.from_iterable(range(200)).dispatch().map(_times2)
    config = loader_config(num_workers=0, chunk_size=8)
    config = cp.LoaderConfig(workers=config.workers, seed=0, pin_memory=True)
    with cp.Loader(pipe, config) as loader:
        it = iter(loader)
        got = [next(it) for _ in range(3)]
        sd = loader.state_dict()
    _inject_thread_start(monkeypatch, "centralpipe-pin", after)
    with cp.Loader(pipe, config) as loader:
        loader.load_state_dict(sd)
        with pytest.raises(KeyboardInterrupt):
            next(iter(loader))
        resumed = loader.state_dict()
        assert resumed["in_flight"]["dispatch"]["first_seq"] == 3
        loader.load_state_dict(resumed)
        rest = collect(loader)
    assert got + rest == [2 * i for i in range(200)]
    assert [t for t in threading.enumerate() if t.name == "centralpipe-pin"] == []
