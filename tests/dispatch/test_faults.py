"""Workers that die, hang or raise: recovered exactly, or reported clearly."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import centralpipe as cp
from tests.fns import faulty
from tests.support.leaks import alive

N = 120


def _loader(fn: Any, *, n: int = N, workers: int = 2, **kw: Any) -> cp.Loader[Any]:
    kw.setdefault("start_method", "fork")
    # Worker isolation is under test: every item runs in a worker, none in
    # the main process while a forkserver pool starts (no inline warm start).
    kw.setdefault("start_inline", False)
    cfg = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=workers, **kw))
    return cp.Loader(cp.Pipeline.from_iterable(range(n)).dispatch().map(fn), cfg)


WORKERS_AND_BUFFERS = [pytest.param(w, b, id=f"{w}w-buf{b}") for w in (1, 2, 4) for b in (8, None)]


@pytest.mark.parametrize(("workers", "buffer"), WORKERS_AND_BUFFERS)
def test_sigkilled_worker_is_replaced_and_output_is_exact(
    tmp_path: Path, workers: int, buffer: int | None
) -> None:
    """A worker killed mid-epoch is replaced; its items are re-sent; nothing lost."""
    fn = functools.partial(faulty.kill_once, at=57, marker=str(tmp_path / "m"))
    with _loader(fn, workers=workers, buffer_size=buffer, chunk_size=3) as loader:
        assert list(loader) == list(range(N))
        assert loader.metrics()["dispatch"]["restarts"] == 1


def test_worker_killed_from_outside_with_chunks_in_flight() -> None:
    """SIGKILL from another process while several chunks are in flight: exact output."""
    with _loader(faulty.slow_identity, n=400, chunk_size=2, buffer_size=64) as loader:
        out = []
        for i, x in enumerate(loader):
            out.append(x)
            if i == 50:
                os.kill(loader.worker_pids()[0], signal.SIGKILL)
        assert out == list(range(400))
        assert loader.metrics()["dispatch"]["restarts"] == 1


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_segfault_once_is_recovered(tmp_path: Path, start_method: str) -> None:
    """A segfault in a worker stage is survived like any death."""
    fn = functools.partial(faulty.segfault_once, at=33, marker=str(tmp_path / "m"))
    with _loader(fn, start_method=start_method) as loader:
        assert list(loader) == list(range(N))


def test_poison_item_is_reported_by_seq() -> None:
    """An item that kills every worker it reaches is named by seq, with the signal."""
    fn = functools.partial(faulty.segfault_always, at=40)
    with _loader(fn) as loader, pytest.raises(cp.WorkerError) as info:
        list(loader)
    err = info.value
    assert err.seq == 40
    assert err.stage == "map_2"
    assert "SIGSEGV" in str(err)
    assert err.exitcode == -signal.SIGSEGV


def test_poison_item_is_skipped_with_on_error_skip() -> None:
    """With on_error='skip' a poison item is skipped and counted; the rest is exact."""
    fn = functools.partial(faulty.segfault_always, at=40)
    with _loader(fn, on_error="skip") as loader:
        assert list(loader) == [x for x in range(N) if x != 40]
        assert loader.metrics()["dispatch"]["skipped"] == 1


def test_max_restarts_gives_worker_error_with_exit_code(tmp_path: Path) -> None:
    """More deaths than max_restarts in one epoch raise WorkerError with the exit code."""
    fn = functools.partial(faulty.kill_once_each, every=10, marker_dir=str(tmp_path))
    with _loader(fn, max_restarts=2, chunk_size=1) as loader, pytest.raises(cp.WorkerError) as info:
        list(loader)
    assert "max_restarts=2" in str(info.value)
    assert "SIGKILL" in str(info.value)
    assert info.value.exitcode == -signal.SIGKILL


def test_os_exit_is_reported_with_exit_code() -> None:
    """A worker that calls os._exit(3) on an item: the error says 'exit code 3'."""
    fn = functools.partial(faulty.exit_always, at=5, code=3)
    with _loader(fn) as loader, pytest.raises(cp.WorkerError, match="exit code 3") as info:
        list(loader)
    assert info.value.seq == 5


def test_restarts_reset_each_epoch(tmp_path: Path) -> None:
    """max_restarts counts per epoch: one death per epoch never exceeds max_restarts=1."""
    for epoch in range(3):
        fn = functools.partial(faulty.kill_once, at=10 + epoch, marker=str(tmp_path / f"m{epoch}"))
        with _loader(fn, max_restarts=1) as loader:
            assert list(loader) == list(range(N))


def test_hung_item_is_retried_on_a_fresh_worker(tmp_path: Path) -> None:
    """timeout_s kills a worker stuck on an item; the retry succeeds; output exact."""
    fn = functools.partial(faulty.hang_once, at=20, marker=str(tmp_path / "m"))
    with _loader(fn, timeout_s=0.5) as loader:
        assert list(loader) == list(range(N))
        assert loader.metrics()["dispatch"]["restarts"] == 1


def test_item_that_hangs_twice_is_reported() -> None:
    """An item that hangs again on the fresh worker is a WorkerError naming it."""
    fn = functools.partial(faulty.hang_always, at=20)
    with _loader(fn, timeout_s=0.3) as loader, pytest.raises(cp.WorkerError, match="hung") as info:
        list(loader)
    assert info.value.seq == 20


@pytest.mark.parametrize("workers", [0, 2])
def test_worker_stage_exception_is_worker_error(workers: int) -> None:
    """A raising worker stage gives WorkerError with stage, seq, type and traceback,
    after every earlier item was delivered."""
    fn = functools.partial(faulty.raise_at, at=frozenset({17}))
    out: list[int] = []
    with _loader(fn, workers=workers) as loader, pytest.raises(cp.WorkerError) as info:
        for x in loader:
            out.append(x)
    err = info.value
    assert out == list(range(17))
    assert (err.stage, err.seq, err.exc_type) == ("map_2", 17, "BadValue")
    assert err.remote_traceback is not None and "raise_at" in err.remote_traceback
    assert "bad item 17" in str(err)


@pytest.mark.parametrize("workers", [0, 2])
def test_on_error_skip_counts_and_logs(workers: int, caplog: pytest.LogCaptureFixture) -> None:
    """on_error='skip' drops failing items, counts them, and logs each once."""
    fn = functools.partial(faulty.raise_at, at=frozenset({3, 50, 51}))
    with _loader(fn, workers=workers, on_error="skip") as loader:
        assert list(loader) == [x for x in range(N) if x not in (3, 50, 51)]
        assert loader.metrics()["dispatch"]["skipped"] == 3
    assert sum("seq 50" in r.getMessage() for r in caplog.records) == 1


def test_checkpoint_after_worker_error_retries_the_item() -> None:
    """The checkpoint after a WorkerError resumes at the failing item (it is not lost)."""
    fn = functools.partial(faulty.raise_at, at=frozenset({17}))
    with _loader(fn) as loader:
        with pytest.raises(cp.WorkerError):
            list(loader)
        sd = loader.state_dict()
    ok = functools.partial(faulty.raise_at, at=frozenset())
    with _loader(ok) as resumed:
        resumed.load_state_dict(sd)
        assert list(resumed) == list(range(17, N))


def test_unpicklable_result_names_the_stage() -> None:
    """A worker result that cannot be pickled is a WorkerError naming the stage."""
    fn = functools.partial(faulty.unpicklable_at, at=9)
    with _loader(fn) as loader, pytest.raises(cp.WorkerError, match="cannot be pickled") as info:
        list(loader)
    assert (info.value.stage, info.value.seq) == ("map_2", 9)


@pytest.mark.parametrize("workers", [0, 2])
def test_unpicklable_central_item_fails_alone_at_the_dispatch_stage(workers: int) -> None:
    """A central item that cannot be pickled for the worker stages is a
    WorkerError at 'dispatch' with its own seq, after the items before it."""
    cfg = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=workers, start_method="fork", chunk_size=8)
    )
    pipe = (
        cp.Pipeline.from_iterable(range(10))
        .map(faulty.unpicklable_at_5)
        .dispatch()
        .map(faulty.identity)
    )
    out: list[int] = []
    with cp.Loader(pipe, cfg) as loader, pytest.raises(cp.WorkerError, match="pickled") as info:
        for x in loader:
            out.append(x)
    assert out == [0, 1, 2, 3, 4]
    assert (info.value.stage, info.value.seq) == ("dispatch", 5)


@pytest.mark.parametrize("workers", [0, 2])
def test_unpicklable_central_item_is_skipped_with_on_error_skip(workers: int) -> None:
    """With on_error='skip' only the unpicklable item is dropped."""
    cfg = cp.LoaderConfig(
        workers=cp.WorkerConfig(
            num_workers=workers, start_method="fork", chunk_size=8, on_error="skip"
        )
    )
    pipe = (
        cp.Pipeline.from_iterable(range(10))
        .map(faulty.unpicklable_at_5)
        .dispatch()
        .map(faulty.identity)
    )
    with cp.Loader(pipe, cfg) as loader:
        assert list(loader) == [0, 1, 2, 3, 4, 6, 7, 8, 9]
        assert loader.metrics()["dispatch"]["skipped"] == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_central_exception_keeps_its_type_and_names_the_stage(workers: int) -> None:
    """An exception in a central stage reaches the consumer unchanged, with a note."""
    cfg = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=workers, start_method="fork"))
    fn = functools.partial(faulty.central_raise_at, at=25)
    pipe = (
        cp.Pipeline.from_iterable(range(50)).map(fn, name="parse").dispatch().map(faulty.identity)
    )
    out: list[int] = []
    with cp.Loader(pipe, cfg) as loader, pytest.raises(KeyError) as info:
        for x in loader:
            out.append(x)
    assert out == list(range(25))
    assert any("parse" in note for note in getattr(info.value, "__notes__", []))


# -- shutdown -------------------------------------------------------------------------------


def test_close_mid_epoch_and_twice() -> None:
    """close() mid-epoch stops everything; a second close() is a no-op."""
    loader = _loader(faulty.slow_identity, n=1000)
    it = iter(loader)
    next(it)
    pids = loader.worker_pids()
    assert len(pids) == 2
    loader.close()
    loader.close()
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)


def test_garbage_collection_without_close_ends_workers() -> None:
    """A loader dropped mid-epoch without close() leaves no worker behind."""
    import gc

    loader = _loader(faulty.slow_identity, n=1000)
    it = iter(loader)
    next(it)
    del it, loader
    gc.collect()


def test_exception_in_training_loop_inside_with() -> None:
    """An exception in the consumer's loop body leaves no worker or thread behind."""
    with pytest.raises(ZeroDivisionError), _loader(faulty.slow_identity, n=1000) as loader:
        for x in loader:
            if x == 30:
                raise ZeroDivisionError


def test_break_then_next_epoch_then_close() -> None:
    """Breaking out of an epoch and starting the next one works; workers persist."""
    with _loader(faulty.identity, n=500) as loader:
        for x in loader:
            if x == 10:
                break
        pids = loader.worker_pids()
        assert list(loader) == list(range(500))
        assert loader.worker_pids() == pids
        assert loader.epoch == 2


_SCRIPT = """
import sys, time, os
import centralpipe as cp
from tests.fns import faulty

def main():
    workers = cp.WorkerConfig(num_workers=2, start_method=sys.argv[1], start_inline=False)
    cfg = cp.LoaderConfig(workers=workers)
    pipe = cp.Pipeline.from_iterable(range(10**6)).dispatch().map(faulty.slow_identity)
    loader = cp.Loader(pipe, cfg)
    it = iter(loader)
    next(it)
    print(" ".join(map(str, loader.worker_pids())), flush=True)
    mode = sys.argv[2]
    if mode == "sigint":
        os.kill(os.getpid(), 2)
        for _ in it:
            pass
    elif mode == "exit":
        os._exit(0)
    else:
        time.sleep(60)

if __name__ == "__main__":
    main()
"""


def _run_script(
    tmp_path: Path, start_method: str, mode: str
) -> tuple[subprocess.Popen[str], list[int]]:
    script = tmp_path / "victim.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(
        [sys.executable, str(script), start_method, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    pids = [int(p) for p in line.split()]
    assert len(pids) == 2, (line, proc.stderr.read() if proc.stderr else "")
    return proc, pids


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_workers_exit_when_main_process_is_sigkilled(tmp_path: Path, start_method: str) -> None:
    """If the main process is killed outright, every worker exits within seconds."""
    proc, pids = _run_script(tmp_path, start_method, "sleep")
    proc.kill()
    proc.wait(10)
    left = _wait_gone(pids, 10.0)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"orphaned workers: {left}"


def test_workers_exit_when_main_process_calls_os_exit(tmp_path: Path) -> None:
    """os._exit in the main process (no cleanup at all) still ends the workers."""
    proc, pids = _run_script(tmp_path, "fork", "exit")
    proc.wait(10)
    assert not _wait_gone(pids, 10.0)


def test_ctrl_c_in_consumer_ends_workers(tmp_path: Path) -> None:
    """KeyboardInterrupt in the training loop: the process exits, workers end."""
    proc, pids = _run_script(tmp_path, "fork", "sigint")
    proc.wait(20)
    assert proc.returncode != 0
    assert proc.stderr is not None and "KeyboardInterrupt" in proc.stderr.read()
    assert not _wait_gone(pids, 10.0)


@pytest.mark.parametrize("workers", [0, 2])
def test_checkpoint_after_central_exception_continues_after_the_item(workers: int) -> None:
    """After a central stage raises, the checkpoint resumes right after the item
    it raised on, in the same epoch (that item was consumed by the stage)."""
    cfg = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=workers, start_method="fork"))
    fn = functools.partial(faulty.central_raise_at, at=25)
    pipe = (
        cp.Pipeline.from_iterable(range(50)).map(fn, name="parse").dispatch().map(faulty.identity)
    )
    with cp.Loader(pipe, cfg) as loader:
        with pytest.raises(KeyError):
            list(loader)
        sd = loader.state_dict()
    assert sd["finished"] is False and sd["epoch"] == 1
    with cp.Loader(pipe, cfg) as resumed:
        resumed.load_state_dict(sd)
        assert list(resumed) == list(range(26, 50))
        assert resumed.epoch == 1


def test_iterator_stops_right_after_close() -> None:
    """An iterator of a closed loader raises at its next item, mid-chunk too."""
    loader = _loader(faulty.identity, n=5000, workers=0)
    it = iter(loader)
    next(it)
    loader.close()
    with pytest.raises(RuntimeError, match="superseded"):
        next(it)


def test_close_returns_while_workers_are_blocked_on_full_pipes() -> None:
    """close() is bounded even when workers are blocked writing large results that
    nobody reads and their input pipes are full (unlimited buffer)."""
    import threading

    cfg = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=2, buffer_size=None, chunk_size=1, start_method="fork")
    )
    for _ in range(3):
        pipe = (
            cp.Pipeline.from_iterable(range(6))
            .map(faulty.big_input)
            .dispatch()
            .map(faulty.big_output)
        )
        loader = cp.Loader(pipe, cfg)
        it = iter(loader)
        next(it)
        time.sleep(0.3)
        closer = threading.Thread(target=loader.close)
        closer.start()
        closer.join(20)
        assert not closer.is_alive(), "close() hung"
