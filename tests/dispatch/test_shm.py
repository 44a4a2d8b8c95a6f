"""The shared-memory rings that carry large results (``dispatch.shm``).

Exact outputs through the rings for every start method; a worker that dies
halfway through a ring write yields no torn result; rings stay one per
worker across many restarts; nothing in ``/dev/shm`` after close or a
SIGKILL of the main process (the leak fixture checks ``/dev/shm`` after
every test); the ring protocol's own bounds; ``shared_memory_bytes``
validation.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import centralpipe as cp
from centralpipe.dispatch import timeouts
from centralpipe.dispatch.wire import ringreader, ringwriter
from tests.fns import ring_faults
from tests.support.leaks import foreign, shm_entries, wait_for_new_shm

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.skipif(not ringreader.available(), reason="no os.memfd_create here")


def _config(start_method: str = "fork", **kw: Any) -> cp.LoaderConfig:
    # Every result crosses a ring: none is run inline while a pool starts.
    kw.setdefault("start_inline", False)
    workers = cp.WorkerConfig(num_workers=2, start_method=start_method, **kw)
    return cp.LoaderConfig(workers=workers)


def _ring_maps() -> int:
    """Mappings of centralpipe rings in this process."""
    with open("/proc/self/maps") as f:
        return sum("centralpipe-ring" in line for line in f)


def _transport(loader: cp.Loader[Any]) -> dict[str, int]:
    out: dict[str, int] = loader.metrics()["dispatch"]["transport"]
    return out


@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_results_cross_the_ring_exactly(start_method: str) -> None:
    """1 KiB to 4 MiB tensors arrive exact through the rings, for every start method."""
    n = 24 if start_method == "spawn" else 60
    pipe = cp.Pipeline.from_iterable(range(n)).dispatch().map(ring_faults.sized)
    with cp.Loader(pipe, _config(start_method)) as loader:
        out = list(loader)
        moved = _transport(loader)
    assert [t.numel() for t in out] == [ring_faults.sized(i).numel() for i in range(n)]
    for i, t in enumerate(out):
        assert torch.equal(t, ring_faults.sized(i)), i
    assert moved["shared_memory_bytes"] > 0


def test_sharing_and_numpy_kept_through_the_ring() -> None:
    """A view arrives sharing its base's memory; numpy arrays stay numpy."""
    fn = functools.partial(ring_faults.kill_each_and_tensor, every=10**9, marker_dir="/")
    pipe = cp.Pipeline.from_iterable(range(1, 30)).dispatch().map(fn)
    with cp.Loader(pipe, _config()) as loader:
        out = list(loader)
        assert _transport(loader)["shared_memory_bytes"] > 0
    for i, d in enumerate(out, 1):
        assert torch.equal(d["t"], torch.full((16384,), float(i)))
        assert d["view"].untyped_storage().data_ptr() == d["t"].untyped_storage().data_ptr()
        d["t"][0] = -1.0
        assert float(d["view"][0]) == -1.0
        assert isinstance(d["a"], np.ndarray) and np.array_equal(d["a"], np.full(8192, i))


def test_zero_turns_the_ring_off() -> None:
    """``shared_memory_bytes=0``: same outputs, every buffer through the pipe."""
    pipe = cp.Pipeline.from_iterable(range(40)).dispatch().map(ring_faults.tensor_of)
    with cp.Loader(pipe, _config(shared_memory_bytes=0)) as loader:
        gc.collect()  # results of earlier tests, kept in reference cycles
        out = list(loader)
        assert "transport" not in loader.metrics()["dispatch"] or (
            _transport(loader)["shared_memory_bytes"] == 0
        )
        assert _ring_maps() == 0
    assert all(torch.equal(t, ring_faults.tensor_of(i)) for i, t in enumerate(out))


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_worker_killed_mid_write_yields_no_torn_result(tmp_path: Path, start_method: str) -> None:
    """A worker SIGKILLed halfway through writing a result into its ring: the
    chunk is redone by its replacement; every output is exact, none torn."""
    marker = str(tmp_path / "m")
    fn = functools.partial(ring_faults.tear_once, at=37, marker=marker)
    pipe = cp.Pipeline.from_iterable(range(120)).dispatch().map(fn)
    with cp.Loader(pipe, _config(start_method, chunk_size=8)) as loader:
        out = list(loader)
        restarts = loader.metrics()["dispatch"]["restarts"]
    assert int(Path(marker + ".torn").read_text()) >= 0, "the torn write did not happen"
    assert restarts == 1
    assert len(out) == 120
    for i, t in enumerate(out):
        assert torch.equal(t, ring_faults.tensor_of(i)), f"item {i} is torn"


def _epoch(fn: Any, config: cp.LoaderConfig) -> tuple[int, int]:
    """(restarts, descriptors open) at the end of one epoch of ``fn``, once
    its outputs are checked and freed; a second epoch (no kills left: each
    happens once) must then go through the rings of the last workers."""
    pipe = cp.Pipeline.from_iterable(range(1, 301)).dispatch().map(fn)
    with cp.Loader(pipe, config) as loader:
        out = list(loader)
        for i, d in enumerate(out, 1):
            assert torch.equal(d["t"], torch.full((16384,), float(i)))
            assert np.array_equal(d["a"], np.full(8192, i))
        del out, d
        gc.collect()  # results lent from the rings of killed workers hold those
        assert _ring_maps() == 2
        assert _transport(loader)["shared_memory_bytes"] > 0
        restarts = loader.metrics()["dispatch"]["restarts"]
        fds = len(os.listdir("/proc/self/fd"))
        before = _transport(loader)["shared_memory_bytes"]
        again = list(loader)
        assert [float(d["t"][0]) for d in again] == [float(i) for i in range(1, 301)]
        assert loader.metrics()["dispatch"]["restarts"] == restarts
        # every tensor and array of the second epoch came through the rings
        assert _transport(loader)["shared_memory_bytes"] - before >= 300 * (65536 + 32768)
        del again
        gc.collect()
        return restarts, fds


def test_rings_stay_one_per_worker_across_restarts(tmp_path: Path) -> None:
    """Twelve worker kills: the rings in use stay one per worker, the old ones
    are unmapped once the results lent from them are freed, no descriptor
    piles up, and every output is exact."""
    config = _config(max_restarts=20, chunk_size=5)
    calm = functools.partial(ring_faults.kill_each_and_tensor, every=10**9, marker_dir="/")
    _, fds_calm = _epoch(calm, config)
    fn = functools.partial(ring_faults.kill_each_and_tensor, every=25, marker_dir=str(tmp_path))
    restarts, fds_killed = _epoch(fn, config)
    assert restarts == 12
    assert fds_killed == fds_calm
    assert _ring_maps() == 0


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_nothing_in_dev_shm_after_the_main_process_is_killed(start_method: str) -> None:
    """SIGKILL of the main process mid-epoch: its workers exit, and nothing is
    left in /dev/shm (the rings have no name)."""
    before = shm_entries()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.scripts.ring_main", start_method],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    *pids, moved = (int(x) for x in proc.stdout.split())
    assert len(pids) == 2 and moved > 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        alive = [p for p in pids if psutil.pid_exists(p)]
        if all(psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in alive):
            break
        time.sleep(0.05)
    assert not wait_for_new_shm(before, 1.0)


def test_the_leak_fixture_fails_a_test_that_leaves_dev_shm_entries(tmp_path: Path) -> None:
    """The autouse leak fixture fails a test that leaves an entry in /dev/shm
    (naming it; pytest reports it as an error at teardown) and passes one
    that removes its entry again."""
    name = f"centralpipe-leak-probe-{os.getpid()}"
    env = {**os.environ, "CENTRALPIPE_LEAK_PROBE": name}
    args = [
        "-m",
        "pytest",
        "tests/scripts/leak_probe.py",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
    ]
    try:
        done = subprocess.run(
            [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        for path in (Path("/dev/shm") / name, Path("/dev/shm") / f"{name}-gone"):
            path.unlink(missing_ok=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 passed, 1 error" in done.stdout, done.stdout  # the fixture fails at teardown
    assert "ERROR at teardown of test_leaves_an_entry_in_dev_shm" in done.stdout
    assert f"1 new entry(ies) in /dev/shm after the test: ['{name}']" in done.stdout


def test_an_entry_only_another_process_tree_holds_is_not_this_tests_leak() -> None:
    """An entry held open only by a process outside this tree (a concurrent
    session's) is not reported; the same entry once nobody holds it is."""
    name = f"centralpipe-foreign-probe-{os.getpid()}"
    path = Path("/dev/shm") / name
    holder = f"import time; f = open({str(path)!r}, 'ab'); time.sleep(30)"
    # The shell starts the holder in the background and exits, so the holder is
    # re-parented away from this process tree.
    shell = subprocess.Popen(
        ["sh", "-c", f'{sys.executable} -c "{holder}" >/dev/null 2>&1 & echo $!'],
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = shell.communicate(timeout=30)
    pid = int(out.split()[0])
    try:
        deadline = time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert path.exists()
        assert foreign({name}) == {name}
        assert not wait_for_new_shm(set(), 0.0) & {name}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.05)
    try:
        assert foreign({name}) == set()
        assert name in wait_for_new_shm(set(), 0.0)
    finally:
        path.unlink(missing_ok=True)


# -- the ring protocol itself -----------------------------------------------------


def _pair(capacity: int = 2**20) -> tuple[ringreader.Ring, ringwriter.RingWriter]:
    """A ring and a writer on it in this process (as a worker would get it)."""
    import multiprocessing

    ring = ringreader.Ring(capacity)
    a, b = multiprocessing.Pipe(duplex=True)
    try:
        assert ring.hand_over(a)
        writer = ringwriter.receive_ring(b)
    finally:
        a.close()
        b.close()
    return ring, writer


def _fill(k: int, n: int) -> memoryview:
    return memoryview(bytes([k % 256]) * n)


def test_writer_never_overwrites_what_is_not_released() -> None:
    """The writer refuses (-1: use the pipe) while every byte is lent or
    unread; a lent buffer is reused only once its array is freed; a copied
    one at once; every buffer reads back as written."""
    ring, writer = _pair()
    block = 256 * 1024
    try:
        placed = [writer.place(_fill(k, block)) for k in range(4)]
        assert placed == [0, block, 2 * block, 3 * block]
        assert writer.place(_fill(9, block)) == -1  # full: nothing released
        lent = [ring.take(off, block) for off in placed[:3]]  # 3/4 of the ring: lent
        copied = ring.take(placed[3], block)  # over LEND_SHARE: copied, released
        assert ring.lent == 3 * block and ring.lent_bytes == 3 * block
        ring.flush()
        assert writer.place(_fill(7, block)) == 3 * block  # the copied one's space
        assert writer.place(_fill(8, block)) == -1  # the lent ones are still in use
        del lent[1]  # frees its space, and only that
        assert writer.place(_fill(8, block)) == block
        assert bytes(lent[0]) == bytes([0]) * block and bytes(lent[1]) == bytes([2]) * block
        assert bytes(copied) == bytes([3]) * block
        assert writer.place(_fill(1, 1024)) == -1  # small buffers use the pipe
        assert writer.place(_fill(1, 2**20 + 64)) == -1  # larger than the ring
    finally:
        ring.close()


@given(steps=st.lists(st.tuples(st.integers(0, 3), st.integers(16, 300)), max_size=60))
@settings(max_examples=40, deadline=None)
def test_a_lent_buffer_is_never_overwritten(steps: list[tuple[int, int]]) -> None:
    """Any mix of writes (sizes 16-300 KiB), takes, and frees in any order: a
    buffer the main process still holds (lent or copied) always reads back as
    written, and lent buffers never overlap."""
    ring, writer = _pair()
    held: list[tuple[Any, int]] = []
    unread: list[tuple[int, int, int]] = []
    try:
        for k, (op, kib) in enumerate(steps):
            if op == 0 or (op == 1 and not unread):
                off = writer.place(_fill(k, kib * 1024))
                if off >= 0:
                    unread.append((off, kib * 1024, k % 256))
            elif op == 1:
                off, size, byte = unread.pop(0)
                held.append((ring.take(off, size), byte))
                ring.flush()
            elif held:
                held.pop((k * 7) % len(held))
            for arr, byte in held:
                assert arr.min() == byte == arr.max()
        spans = sorted(ring._lent.items())
        assert all(a_end <= b for (_, a_end), (b, _) in itertools.pairwise(spans))
    finally:
        ring.close()


def test_writer_waits_for_room_once_while_nothing_is_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full ring makes the writer wait (bounded) for a release once; while
    nothing is released it does not wait again; a release ends that."""
    import select

    waits: list[float] = []
    real_select = select.select

    def counting_select(r: Any, w: Any, x: Any, timeout: float) -> Any:
        waits.append(timeout)
        return real_select(r, w, x, timeout)

    monkeypatch.setattr(ringwriter.select, "select", counting_select)
    ring, writer = _pair()
    block = 256 * 1024
    try:
        for k in range(4):
            assert writer.place(_fill(k, block)) == k * block
        assert not waits
        assert writer.place(_fill(9, block)) == -1
        assert waits and sum(waits) <= timeouts.ROOM_WAIT_S + 1e-6
        count = len(waits)
        for _ in range(20):
            assert writer.place(_fill(9, block)) == -1
        assert len(waits) == count  # stalled: no more waiting
        ring.take(0, block)  # lent, and freed at once
        assert writer.place(_fill(5, block)) == 0
        assert writer.place(_fill(6, block)) == -1  # full again: waits again
        assert len(waits) > count
    finally:
        ring.close()


def test_reader_refuses_space_the_worker_may_not_have_written() -> None:
    """An offset in lent space, misaligned or beyond the ring is an EOFError,
    as for a dead worker, never a read."""
    ring, _ = _pair()
    try:
        lent = ring.take(4096, 256)
        with pytest.raises(EOFError):
            ring.take(4096 - 64, 128)  # overlaps the lent buffer
        with pytest.raises(EOFError):
            ring.take(4096 + 64, 64)  # inside it
        with pytest.raises(EOFError):
            ring.take(8192 + 1, 64)  # misaligned
        with pytest.raises(EOFError):
            ring.take(0, 2**20 + 1)  # longer than the ring
        with pytest.raises(EOFError):
            ring.take(2**20 - 64, 128)  # past its end
        del lent
        assert ring.take(4096, 256) is not None  # released: may be named again
    finally:
        ring.close()
    with pytest.raises(EOFError):
        ring.take(8192, 64)  # closed


def test_a_release_the_full_pipe_refused_is_written_later() -> None:
    """When the release pipe is full the releases are kept and written by
    ``flush``; the writer then sees every one."""
    import fcntl

    size = 2**23  # 512 buffers: more release records than a 4 KiB pipe holds
    ring, writer = _pair(size)
    try:
        assert ring._release_w is not None
        fcntl.fcntl(ring._release_w, fcntl.F_SETPIPE_SZ, 4096)
        block = 16 * 1024
        for off in range(0, size, block):
            assert writer.place(_fill(1, block)) == off
        for off in range(0, size, block):
            ring.take(off, block)  # lent, freed at once (or copied)
        ring.flush()
        assert ring._unsent  # more than the pipe takes
        writer._drain()
        ring.flush()
        writer._drain()
        assert not ring._unsent and writer.used == 0
        assert writer.place(_fill(2, size)) == 0  # the whole ring is free again
    finally:
        ring.close()


def test_space_reserved_for_a_result_that_is_not_sent_is_freed() -> None:
    """Ring space a worker took for an output (``reserve``) that no message
    named is free again after ``forget``; what was sent is not."""
    ring, writer = _pair()
    try:
        a = writer.reserve(300 * 1024)
        b = writer.reserve(300 * 1024)
        assert (a, b) == (0, 300 * 1024)
        writer.sent(a)
        writer.forget()
        assert writer.used == 300 * 1024
        assert writer.reserve(600 * 1024) == 300 * 1024
        assert writer.reserve(16) == -1  # too small for the ring
    finally:
        ring.close()


def test_a_kept_result_outlives_the_loader_and_the_ring() -> None:
    """Results kept after ``close()`` (lent, without a copy) stay exact; the
    ring mappings go with the last of them, and nothing is left in /dev/shm."""
    pipe = cp.Pipeline.from_iterable(range(40)).dispatch().map(ring_faults.tensor_of)
    with cp.Loader(pipe, _config()) as loader:
        out = list(loader)
        assert _transport(loader)["shared_memory_lent_bytes"] > 0
    gc.collect()
    assert all(torch.equal(t, ring_faults.tensor_of(i)) for i, t in enumerate(out))
    out[0] += 1  # writable, as with num_workers=0
    del out
    gc.collect()
    assert _ring_maps() == 0


def test_kept_results_never_leave_a_worker_without_room() -> None:
    """A consumer that keeps every result: lending stops at ``LEND_SHARE`` of
    the ring, later results are copied out, and every kept result stays exact."""
    pipe = cp.Pipeline.from_iterable(range(60)).dispatch().map(ring_faults.tensor_of)
    with cp.Loader(pipe, _config(shared_memory_bytes=2**21)) as loader:
        out = list(loader)
        moved = _transport(loader)
    assert all(torch.equal(t, ring_faults.tensor_of(i)) for i, t in enumerate(out))
    assert 0 < moved["shared_memory_lent_bytes"] <= 2 * 2**21 * ringreader.LEND_SHARE
    assert moved["shared_memory_bytes"] > moved["shared_memory_lent_bytes"]


def test_hand_over_to_a_closed_pipe_is_reported() -> None:
    """Handing a ring to a worker that is gone returns False and closes our copies."""
    import multiprocessing

    ring = ringreader.Ring(2**20)
    a, b = multiprocessing.Pipe(duplex=True)
    b.close()
    try:
        assert ring.hand_over(a) is False
        assert len(ring.fds()) == 1  # only the release pipe's write end is left
    finally:
        a.close()
        ring.close()
    assert ring.fds() == []


def test_receive_ring_refuses_a_pipe_without_a_ring() -> None:
    """A worker whose pipe starts with anything but a ring hand-over stops
    with EOFError (no descriptors leak)."""
    import multiprocessing

    a, b = multiprocessing.Pipe(duplex=True)
    try:
        a.send_bytes(b"0123456789abcdef")
        with pytest.raises(EOFError):
            ringwriter.receive_ring(b)
        a.close()
        with pytest.raises(EOFError):
            ringwriter.receive_ring(b)
    finally:
        a.close()
        b.close()


# -- configuration ------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [-1, 1, 2**20 - 1, 2**40 + 1, True, 1.5, "64M", None],
    ids=["negative", "one", "below-min", "above-max", "bool", "float", "str", "none"],
)
def test_shared_memory_bytes_is_validated(value: Any) -> None:
    """A bad ``shared_memory_bytes`` is a ConfigError naming the field and the range."""
    with pytest.raises(cp.ConfigError, match="`shared_memory_bytes` must be 0") as info:
        cp.WorkerConfig(shared_memory_bytes=value)
    assert repr(value) in str(info.value)


def test_shared_memory_bytes_round_trips_through_a_dict() -> None:
    """The field is part of ``to_dict``/``from_dict`` like any other."""
    config = cp.LoaderConfig(workers=cp.WorkerConfig(shared_memory_bytes=0))
    data = config.to_dict()
    assert data["workers"]["shared_memory_bytes"] == 0
    assert cp.LoaderConfig.from_dict(data) == config
    with pytest.raises(cp.ConfigError, match="shared_memory_bytes"):
        cp.LoaderConfig.from_dict({"workers": {"shared_memory_bytes": -5}})
