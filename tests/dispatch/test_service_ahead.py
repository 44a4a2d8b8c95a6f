"""``central="service"`` delivers the next output ahead, while the consumer
works, and still answers every call at the consumer's position."""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.dispatch.client import ServiceClient

pytestmark = pytest.mark.timeout(120)

#: Long enough for an ``ahead`` reply to arrive while the "step" runs.
STEP_S = 0.02
N = 14


def double(x: int) -> int:
    return 2 * x


def fails_at_7(x: int) -> int:
    if x == 7:
        raise ValueError("seven")
    return x


def _config(central: str = "service", chunk_size: int = 3) -> cp.LoaderConfig:
    workers = cp.WorkerConfig(num_workers=2, start_method="fork", chunk_size=chunk_size)
    return cp.LoaderConfig(workers=workers, central=central)


def _pipe(fn: Any = double) -> cp.Pipeline:
    return cp.Pipeline.from_iterable(range(N)).count(name="seen").dispatch().map(fn)


def _holds_ahead(loader: cp.Loader[Any]) -> bool:
    """Whether the client has the next output already (read after a step)."""
    central = loader._central
    assert isinstance(central, ServiceClient)
    with central._lock:
        central._drain()
        return central._ahead is not None


def _all_results_in(loader: cp.Loader[Any]) -> None:
    """Wait until the workers' results for all N items are in, so that the
    service has the next output ready whenever the client asks ahead (on a
    busy machine a worker may otherwise be late)."""
    deadline = time.monotonic() + 60
    while sum(loader.metrics()["dispatch"]["items_per_worker"]) < N:
        assert time.monotonic() < deadline, "the workers did not finish in 60 s"
        time.sleep(0.01)
    time.sleep(0.2)  # the count moves just before the result is stored


def _head(loader: cp.Loader[Any], k: int) -> tuple[list[Any], Any]:
    """The first k outputs, consumed as a training loop would; every output
    after the first was asked for ahead once all results were in."""
    it = iter(loader)
    head = [next(it)]
    _all_results_in(loader)
    for _ in range(k - 1):
        head.append(next(it))
        time.sleep(STEP_S)  # the consumer's step: the next output arrives meanwhile
    return head, it


@pytest.mark.parametrize("chunk_size", [1, 3], ids=["chunk1", "chunk3"])
def test_states_with_an_output_held_ahead_resume_exactly(chunk_size: int) -> None:
    """At every k, with the next output already at the client, state_dict()
    and query(delivered=True) describe the k outputs the consumer got: a fresh
    loader resumed from it yields exactly the rest."""
    full = [double(i) for i in range(N)]
    held_ahead = 0
    for k in range(1, N):
        with cp.Loader(_pipe(), _config(chunk_size=chunk_size)) as loader:
            head, _ = _head(loader, k)
            held_ahead += _holds_ahead(loader)
            assert loader.query("seen", delivered=True) == {"items": k, "weight": k}
            state = loader.state_dict()
        with cp.Loader(_pipe(), _config(chunk_size=chunk_size)) as loader:
            loader.load_state_dict(state)
            assert head + list(loader) == full, f"k={k}"
    # Not vacuous: the states were taken with the next output at the client
    # (k >= 2: asked for once all results were in).
    assert held_ahead >= N - 3


def test_the_output_held_ahead_is_handed_out_after_a_state() -> None:
    """A state_dict() between two next() calls changes nothing: the output
    delivered ahead is the next one, and the pass goes on in order."""
    with cp.Loader(_pipe(), _config()) as loader:
        head, it = _head(loader, 4)
        assert _holds_ahead(loader)
        state_before = loader.state_dict()
        assert loader.state_dict() == state_before
        assert head + list(it) == [double(i) for i in range(N)]


def test_a_new_pass_drops_the_output_held_ahead() -> None:
    """Breaking out of a pass with an output held ahead, then iterating again,
    starts the next epoch from its first item (nothing of the old pass leaks
    in); a state taken after the break resumes after the k items got."""
    with cp.Loader(_pipe(), _config()) as loader:
        head, it = _head(loader, 5)
        assert _holds_ahead(loader)
        del it
        state = loader.state_dict()
        assert list(loader) == [double(i) for i in range(N)]
        assert loader.epoch == 2
    with cp.Loader(_pipe(), _config()) as loader:
        loader.load_state_dict(state)
        assert head + list(loader) == [double(i) for i in range(N)]


def _up_to_the_error(central: str) -> tuple[list[Any], list[Any]]:
    """The outputs before the failing item, then those of a loader resumed
    from the state taken just before its error was raised."""
    with cp.Loader(_pipe(fails_at_7), _config(central)) as loader:
        head, it = _head(loader, 7)
        state = loader.state_dict()
        with pytest.raises(cp.WorkerError, match="seven"):
            next(it)
    with cp.Loader(_pipe(fails_at_7), _config(central)) as loader:
        loader.load_state_dict(state)
        return head, list(loader)


def test_nothing_is_delivered_ahead_past_a_worker_error() -> None:
    """The outputs before a failing item arrive, then its WorkerError, in
    place; the state taken just before it resumes as process mode's does."""
    head, rest = _up_to_the_error("service")
    assert head == list(range(7))
    assert (head, rest) == _up_to_the_error("process")


def test_process_and_service_states_agree_on_the_delivered_position() -> None:
    """The state's delivered stamp and epoch are the same in both modes at
    the same k, whether or not the service ran ahead."""
    states = {}
    for central in ("process", "service"):
        with cp.Loader(_pipe(), _config(central)) as loader:
            _head(loader, 6)
            if central == "service":
                assert _holds_ahead(loader)
            states[central] = loader.state_dict()
    assert states["service"]["delivered_stamp"] == states["process"]["delivered_stamp"]
    assert states["service"]["epoch"] == states["process"]["epoch"]


def test_metrics_count_the_output_held_ahead_as_not_delivered() -> None:
    """metrics()["dispatch"]["delivered"] is what the consumer got, with the
    next output already at the client."""
    with cp.Loader(_pipe(), _config()) as loader:
        _head(loader, 5)
        assert _holds_ahead(loader)
        assert loader.metrics()["dispatch"]["delivered"] == 5


def test_a_call_right_after_next_goes_out_behind_the_ahead_request() -> None:
    """query() and state_dict() called at once after next(), while the
    ahead request is still owed, are sent behind it (one wait for both
    replies) and still answer at the consumer's position."""
    with cp.Loader(_pipe(), _config()) as loader:
        it = iter(loader)
        head = [next(it)]
        _all_results_in(loader)
        central = loader._central
        assert isinstance(central, ServiceClient)
        for k in range(2, 7):
            head.append(next(it))
            assert [op for op, _ in central._owed] == ["ahead"]
            assert loader.query("seen", delivered=True) == {"items": k, "weight": k}
        assert [op for op, _ in central._owed] == []
        state = loader.state_dict()
        assert head + list(it) == [double(i) for i in range(N)]
    with cp.Loader(_pipe(), _config()) as loader:
        loader.load_state_dict(state)
        assert head + list(loader) == [double(i) for i in range(N)]


def unpicklable_at_2(x: int) -> Any:
    return threading.Lock() if x == 2 else x


def test_an_output_that_cannot_cross_ahead_is_an_error_in_its_place() -> None:
    """An output delivered ahead that cannot be pickled is the error raised
    in its place (as without the ahead request), never silently skipped; the
    pass goes on after it."""
    pipe = cp.Pipeline.from_iterable(range(8)).dispatch().map(unpicklable_at_2)
    workers = cp.WorkerConfig(num_workers=0, chunk_size=4)
    with cp.Loader(pipe, cp.LoaderConfig(workers=workers, central="service")) as loader:
        it = iter(loader)
        got = [next(it), next(it)]
        time.sleep(STEP_S)
        with pytest.raises(RuntimeError, match="could not send a reply"):
            next(it)
        got += list(it)
    assert got == [0, 1, 3, 4, 5, 6, 7]


def big_list(x: int) -> list[int]:
    return [x] * 2_000_000  # pickled, ~10 MB: more than a socket's 4 MiB buffer; not ring-able


def test_close_with_a_large_output_held_ahead_is_quick_and_clean() -> None:
    """Breaking out of a pass whose next output (larger than the socket's
    buffer) was already on its way, then close(): the service reads close,
    ends by itself (exit code 0) and nothing is killed."""
    pipe = cp.Pipeline.from_iterable(range(6)).dispatch().map(big_list)
    config = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=1, start_method="fork", chunk_size=1),
        central="service",
    )
    loader = cp.Loader(pipe, config)
    it = iter(loader)
    assert next(it)[0] == 0
    time.sleep(1.0)  # the next results are in: the ahead after the next output is delivered
    assert next(it)[0] == 1
    time.sleep(0.5)  # the ahead reply is being written, blocked on the full socket
    central = loader._central
    assert isinstance(central, ServiceClient)
    assert [op for op, _ in central._owed] == ["ahead"]
    proc = central._link.proc
    started = time.monotonic()
    loader.close()
    assert time.monotonic() - started < 5.0
    assert proc.exitcode == 0


class _CutPop(collections.deque):  # type: ignore[type-arg]
    """The client's owed replies, whose next popleft() is followed by a
    KeyboardInterrupt, as a SIGINT lands when that C call returns."""

    armed = False

    def popleft(self) -> Any:
        value = super().popleft()
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return value


def test_an_interrupt_after_an_ahead_reply_is_read_loses_nothing() -> None:
    """A Ctrl-C as the ahead reply's record leaves the queue of owed replies:
    the next next() hands that output out; every output arrives once."""
    with cp.Loader(_pipe(), _config()) as loader:
        head, it = _head(loader, 3)
        central = loader._central
        assert isinstance(central, ServiceClient)
        cut = _CutPop(central._owed)
        central._owed = central._link.owed = cut
        time.sleep(STEP_S)
        cut.armed = True
        with pytest.raises(KeyboardInterrupt):
            next(it)
        assert not cut.armed
        assert head + list(it) == [double(i) for i in range(N)]


def _cut_write() -> Any:
    """``os.write`` whose next call raises KeyboardInterrupt before writing a
    byte, as a SIGINT does when it interrupts the system call."""
    real = os.write
    state = {"armed": False, "fired": False}

    def write(fd: int, data: Any) -> int:
        if state["armed"]:
            state["armed"], state["fired"] = False, True
            raise KeyboardInterrupt
        return real(fd, data)

    write.state = state  # type: ignore[attr-defined]
    return write


def _interrupt_after_the_write(state: dict[str, bool]) -> Any:
    """A profile function raising KeyboardInterrupt as the client's
    record-and-write C call returns (where CPython handles a SIGINT that
    came meanwhile), once ``state["armed"]``."""

    def profile(frame: Any, event: str, arg: Any) -> None:
        if (
            state["armed"]
            and event == "c_return"
            and frame.f_code.co_name == "_send"
            and getattr(arg, "__name__", "") == "extend"
        ):
            state["armed"], state["fired"] = False, True
            sys.setprofile(None)
            raise KeyboardInterrupt

    return profile


@pytest.mark.parametrize("cut_before", [True, False], ids=["before-write", "after-write"])
def test_an_interrupt_at_the_request_write_never_hangs_or_loses(
    monkeypatch: pytest.MonkeyPatch, cut_before: bool
) -> None:
    """A Ctrl-C landing as the request for the next output is written (before
    any byte, or as the write returns): the client's record of owed replies
    matches what was sent, so the next calls neither wait for a reply that
    will never come nor read one out of step; every output arrives once."""
    with cp.Loader(_pipe(), _config()) as loader:
        head, it = _head(loader, 3)
        if cut_before:
            write = _cut_write()
            monkeypatch.setattr(os, "write", write)
            state = write.state
            state["armed"] = True
            with pytest.raises(KeyboardInterrupt):
                next(it)  # its output is kept; the interrupt lands at the ahead request
            monkeypatch.undo()
        else:
            state = {"armed": True, "fired": False}
            sys.setprofile(_interrupt_after_the_write(state))
            try:
                with pytest.raises(KeyboardInterrupt):
                    next(it)
            finally:
                sys.setprofile(None)
        assert state["fired"]
        assert loader.query("seen", delivered=True)["items"] >= 3
        assert head + list(it) == [double(i) for i in range(N)]
