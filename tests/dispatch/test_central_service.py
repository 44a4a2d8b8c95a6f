"""``LoaderConfig(central="service")``: the central part in a helper process,
with the same outputs, checkpoints and API as ``"process"``; its faults and
its rendezvous (private directory, peer credentials, token)."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import centralpipe as cp
from centralpipe.dispatch import priority, rendezvous, timeouts
from centralpipe.testing import assert_resumes_exactly
from tests.support.leaks import alive

MODES = ("process", "service")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "service_main.py"
#: Bound on how long the service outlives its killed client (typically < 1 s).
EXIT_WITHIN_S = 10.0


def square(x: int) -> int:
    return x * x


def block(x: int) -> torch.Tensor:
    return torch.full((32, 256), float(x))


def odd(x: int) -> bool:
    return x % 2 == 1


def fails_at_5(x: int) -> int:
    if x == 5:
        raise KeyError("central boom")
    return x


def worker_fails_at_3(x: int) -> int:
    if x == 3:
        raise ValueError("worker boom")
    return x


def _config(central: str, num_workers: int = 2, chunk_size: int = 2) -> cp.LoaderConfig:
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(
            num_workers=num_workers, start_method="fork", chunk_size=chunk_size
        ),
        central=central,
    )


def _pipe(n: int = 12) -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(range(n))
        .map(square)
        .batch(2)
        .count(name="seen", weight_fn=len)
        .dispatch()
        .map(len)
    )


def _tensor_pipe(n: int = 8) -> cp.Pipeline:
    return cp.Pipeline.from_iterable(range(n)).count(name="seen").dispatch().map(block)


def _values(items: list[torch.Tensor]) -> list[float]:
    return [float(t[0, 0]) for t in items]


def test_service_resumes_exactly_at_every_step() -> None:
    """At every step k, the first k items plus a fresh service loader resumed
    from the state at k equal the uninterrupted run, over two epochs."""
    pipe = cp.Pipeline.from_iterable(range(3)).map(square).dispatch().map(str)
    assert_resumes_exactly(pipe, _config("service", num_workers=0), epochs=2)


@pytest.mark.parametrize(
    ("saved_in", "resumed_in"),
    [(a, b) for a in MODES for b in MODES],
    ids=[f"{a}-to-{b}" for a in MODES for b in MODES],
)
def test_a_state_saved_in_one_mode_resumes_in_any(saved_in: str, resumed_in: str) -> None:
    """The same tensor outputs in both modes; a state taken after 3 items in
    one mode resumes in the other with exactly the rest, the same state dict
    and the same delivered count."""
    pipe = _tensor_pipe()
    with cp.Loader(pipe, _config(saved_in)) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(3)]
        state = loader.state_dict()
        rest = list(it)
    assert _values(head + rest) == [float(i) for i in range(8)]
    with cp.Loader(pipe, _config(resumed_in, num_workers=1)) as loader:
        loader.load_state_dict(state)
        assert loader.state_dict() == state
        assert loader.epoch == 1
        resumed = list(loader)
        assert loader.query("seen", delivered=True) == {"items": 8, "weight": 8}
    assert _values(resumed) == _values(rest) == [3.0, 4.0, 5.0, 6.0, 7.0]


def test_tensors_reach_the_client_through_the_shared_memory_ring() -> None:
    """Large tensor outputs cross in the ring, lent without a copy: the ring
    counts their bytes, the pipe none of them."""
    with cp.Loader(_tensor_pipe(), _config("service")) as loader:
        out = list(loader)
        ring = loader._central._link.ring  # type: ignore[attr-defined]
        assert ring is not None
        assert ring.ring_bytes >= 8 * 32 * 256 * 4 and ring.pipe_bytes == 0
        assert ring.lent_bytes == ring.ring_bytes
    assert _values(out) == [float(i) for i in range(8)]


def nice_of(pid: int) -> int:
    """The niceness field (the 19th) of ``/proc/<pid>/stat``."""
    stat_line = Path(f"/proc/{pid}/stat").read_text()
    return int(stat_line.rpartition(")")[2].split()[16])


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_the_service_and_its_workers_run_nicer_than_the_training_process(method: str) -> None:
    """The service and its workers run ``priority.NICENESS`` points nicer than
    the training process (however they were started); the training process
    keeps its own niceness, and process mode renices nothing."""
    mine = nice_of(os.getpid())
    config = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=2, start_method=method), central="service"
    )
    with cp.Loader(_pipe(), config) as loader:
        it = iter(loader)
        assert next(it) == 2
        service = loader._central.service_pid  # type: ignore[attr-defined]
        workers = loader.worker_pids()
        assert len(workers) == 2
        expected = min(mine + priority.NICENESS, 19)
        assert [nice_of(p) for p in [service, *workers]] == [expected] * 3
        assert nice_of(os.getpid()) == mine
        assert list(it) == [2] * 5
    with cp.Loader(_pipe(), _config("process")) as loader:
        assert list(loader) == [2] * 6
        assert nice_of(os.getpid()) == mine


def test_the_api_answers_the_same_in_both_modes() -> None:
    """query (live and delivered), total, len, epoch, worker_states, progress
    and the metrics' keys are the same in both modes mid-epoch."""
    seen: dict[str, Any] = {}
    for mode in MODES:
        with cp.Loader(_pipe(), _config(mode)) as loader:
            it = iter(loader)
            first = [next(it) for _ in range(2)]
            seen[mode] = (
                first,
                loader.query("seen", delivered=True),
                loader.total("seen"),
                len(loader),
                loader.epoch,
                len(loader.worker_states()),
                sorted(loader.metrics()),
                sorted(loader.metrics()["dispatch"]),
                list(it),
                [*cp.progress(loader, "seen", disable=True)],
                loader.epoch,
            )
            pids = loader.worker_pids()
            assert len(pids) == 2
            mine = {p.pid for p in psutil.Process().children(recursive=False)}
            assert (set(pids) <= mine) == (mode == "process")
    assert seen["service"] == seen["process"]
    assert seen["service"][1] == {"items": 2, "weight": 4}


@pytest.mark.parametrize(
    ("pipe", "error", "match"),
    [
        pytest.param(
            cp.Pipeline.from_iterable(range(8)).map(fails_at_5).dispatch().map(str),
            KeyError,
            "central boom",
            id="central-stage",
        ),
        pytest.param(
            cp.Pipeline.from_iterable(range(8)).dispatch().map(worker_fails_at_3),
            cp.WorkerError,
            "worker boom",
            id="worker-stage",
        ),
    ],
)
def test_errors_cross_as_themselves(pipe: cp.Pipeline, error: type, match: str) -> None:
    """A stage's error reaches the consumer with its type, message and the
    items before it, in both modes alike."""
    got = {}
    for mode in MODES:
        with cp.Loader(pipe, _config(mode)) as loader:
            out: list[Any] = []
            with pytest.raises(error, match=match) as info:
                out.extend(loader)
            got[mode] = (out, type(info.value), getattr(info.value, "stage", None))
    assert got["service"] == got["process"]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        pytest.param(
            lambda ld: ld.query("nope"), KeyError, "no central stage named 'nope'", id="query"
        ),
        pytest.param(
            lambda ld: ld.query("map_1", delivered=True), ValueError, "count", id="delivered"
        ),
        pytest.param(
            lambda ld: ld.load_state_dict({"format_version": 1}),
            cp.CheckpointError,
            "format_version is 1",
            id="old-format",
        ),
        pytest.param(
            lambda ld: ld.load_state_dict({**ld.state_dict(), "epoch": "x"}),
            cp.CheckpointError,
            "epoch",
            id="damaged",
        ),
        pytest.param(
            lambda ld: ld.load_state_dict("x"), cp.CheckpointError, "dict", id="not-a-dict"
        ),
        pytest.param(lambda ld: ld._set_next_epoch(0), ValueError, "epoch", id="epoch"),
    ],
)
def test_bad_calls_raise_as_in_process_mode(call: Any, error: type, match: str) -> None:
    """Bad input to the service raises the error process mode raises, and the
    loader goes on working."""
    pipe = cp.Pipeline.from_iterable(range(4)).map(square).count(name="seen").dispatch().map(str)
    messages = []
    for mode in MODES:
        with cp.Loader(pipe, _config(mode, num_workers=0)) as loader:
            with pytest.raises(error, match=match) as info:
                call(loader)
            messages.append(str(info.value))
            assert list(loader) == ["0", "1", "4", "9"]
    assert messages[0] == messages[1]


def wait_for_flag(x: int) -> int:
    """Item 0 waits (in a worker) until the file named by ``FLAG_FILE`` exists."""
    if x == 0:
        while not os.path.exists(os.environ["FLAG_FILE"]):
            time.sleep(0.01)
    return x


def test_metrics_never_wait_for_a_next_in_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While another thread's ``next()`` waits for an output, ``metrics()`` and
    ``worker_pids()`` answer at once (a second connection), as in process mode."""
    flag = tmp_path / "go"
    monkeypatch.setenv("FLAG_FILE", str(flag))
    pipe = cp.Pipeline.from_iterable(range(4)).dispatch().map(wait_for_flag)
    with cp.Loader(pipe, _config("service", chunk_size=1)) as loader:
        got: list[int] = []
        it = iter(loader)
        consumer = threading.Thread(target=lambda: got.append(next(it)))
        consumer.start()
        deadline = time.monotonic() + 30
        while loader.metrics()["dispatch"]["dispatched"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        metrics = loader.metrics()
        pids = loader.worker_pids()
        assert consumer.is_alive() and got == []  # answered while next() waits
        assert metrics["dispatch"]["delivered"] == 0 and len(pids) == 2
        flag.touch()
        consumer.join(30)
        assert got == [0] and list(it) == [1, 2, 3]


def _interrupted_next(it: Any) -> None:
    """``next(it)`` cut short by a real SIGINT sent 0.3 s into it."""
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            next(it)
    finally:
        timer.join(10)


def test_ctrl_c_while_waiting_for_an_output_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real SIGINT while ``next()`` waits for the service raises
    ``KeyboardInterrupt``; the service keeps going (it ignores SIGINT), the
    next ``next()`` hands out the output that was on its way, and a state
    then resumes after it, exactly."""

    flag = tmp_path / "go"
    monkeypatch.setenv("FLAG_FILE", str(flag))
    pipe = cp.Pipeline.from_iterable(range(4)).dispatch().map(wait_for_flag)
    with cp.Loader(pipe, _config("service", chunk_size=1)) as loader:
        it = iter(loader)
        _interrupted_next(it)
        flag.touch()
        assert next(it) == 0
        state = loader.state_dict()
        assert list(it) == [1, 2, 3] and loader.epoch == 1  # one pass, not restarted
    with cp.Loader(pipe, _config("service", chunk_size=1)) as loader:
        loader.load_state_dict(state)
        assert list(loader) == [1, 2, 3]


def slow_source() -> Any:
    """A source whose every pass takes a second to open (inside the pass's start)."""
    time.sleep(1.0)
    return iter(range(4))


def test_ctrl_c_while_a_pass_starts_in_the_service_starts_it_once() -> None:
    """A real SIGINT while the service starts a pass: the next ``next()`` takes
    the pass the service started (epoch 1, every item), not a second one."""

    pipe = cp.Pipeline.from_iterable(slow_source).dispatch().map(square)
    with cp.Loader(pipe, _config("service", num_workers=0)) as loader:
        it = iter(loader)
        _interrupted_next(it)
        assert [op for op, _ in loader._central._owed] == ["start"]  # type: ignore[attr-defined]
        assert list(it) == [0, 1, 4, 9] and loader.epoch == 1


def test_garbage_collection_without_close_ends_the_service() -> None:
    """A service loader dropped mid-epoch without ``close()``: its finalizer
    ends the service (and so its workers) at once."""
    loader = cp.Loader(_pipe(), _config("service"))
    it = iter(loader)
    assert next(it) == 2
    pid = loader._central.service_pid  # type: ignore[attr-defined]
    del it, loader
    gc.collect()
    assert not alive(pid)


def test_len_of_an_unknown_length_is_a_type_error_in_the_service() -> None:
    """``len()`` of a loader whose length is unknown raises ``TypeError``."""
    pipe = cp.Pipeline.from_iterable(range(4)).filter(odd).dispatch().map(str)
    with cp.Loader(pipe, _config("service", num_workers=0)) as loader:
        with pytest.raises(TypeError):
            len(loader)
        assert list(loader) == ["1", "3"]


def test_a_killed_service_is_an_error_at_once() -> None:
    """SIGKILL of the service mid-epoch: the next call raises ``ServiceError``
    naming its pid and exit code (no hang), every later call too; close()
    still works and leaves no process."""
    loader = cp.Loader(_tensor_pipe(), _config("service"))
    try:
        it = iter(loader)
        assert float(next(it)[0, 0]) == 0.0
        pid = loader._central.service_pid  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(cp.ServiceError, match=rf"pid {pid}\) died .*exit code -9"):
            list(it)
        with pytest.raises(cp.ServiceError, match="died"):
            loader.state_dict()
    finally:
        loader.close()
    loader.close()  # idempotent


def test_the_service_ends_when_its_client_is_killed() -> None:
    """SIGKILL of the training process (left unreaped) while its service's
    worker is busy: the service and its workers exit on their own."""
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    pids: list[int] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        service = int(proc.stdout.readline())
        deadline = time.monotonic() + 30
        while not pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = [p.pid for p in psutil.Process(service).children()]
        assert pids, "the service started no worker"
        pids.append(service)
        proc.stdin.write("die\n")
        proc.stdin.flush()
        deadline = time.monotonic() + EXIT_WITHIN_S
        while alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not alive(proc.pid)
        died = time.monotonic()
        while any(alive(p) for p in pids) and time.monotonic() - died < EXIT_WITHIN_S:
            time.sleep(0.02)
        assert [p for p in pids if alive(p)] == []
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait(10)


def test_the_socket_is_private_and_gone_once_the_client_is_in() -> None:
    """The service's socket lives in this user's 0700 directory of the job and
    is removed (with the directory) as soon as its client has connected."""
    with cp.Loader(_pipe(), _config("service", num_workers=0)) as loader:
        path = Path(loader._central._link.path)  # type: ignore[attr-defined]
        assert path.parent.name == f"centralpipe-{os.getuid()}-pid-{os.getpid()}"
        assert not path.exists() and not path.parent.exists()
        assert list(loader) == [2] * 6


def test_a_pipeline_that_cannot_be_pickled_for_spawn_is_a_pipeline_error() -> None:
    """With ``spawn`` the pipeline is pickled to the service: a lambda raises
    ``PipelineError`` saying what to do, and no process is left."""
    pipe = cp.Pipeline.from_iterable(range(3)).map(lambda x: x).dispatch().map(str)
    config = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=0, start_method="spawn"), central="service"
    )
    with pytest.raises(cp.PipelineError, match="module level, or use WorkerConfig"):
        cp.Loader(pipe, config)


def test_a_service_that_does_not_start_in_time_is_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A service not ready within ``START_TIMEOUT_S`` is a ``ServiceError``
    saying so, and it is stopped (no process left)."""
    from centralpipe.dispatch import client

    # A service that never reports ready (forked: the child runs the patched
    # target); a real one could be ready before even a 1e-6 s wait began.
    monkeypatch.setattr(client, "serve", _never_ready)
    monkeypatch.setattr(timeouts, "START_TIMEOUT_S", 0.5)
    with pytest.raises(cp.ServiceError, match=r"did not start within START_TIMEOUT_S=0.5 s"):
        cp.Loader(_pipe(), _config("service", num_workers=0))


def _never_ready(*_args: Any) -> None:
    time.sleep(60)


def test_a_stage_that_fails_to_build_fails_the_loader() -> None:
    """An error building the central stages in the service is raised by the
    Loader's constructor, as in process mode."""
    pipe = cp.Pipeline.from_files("/no/such/dir/*.txt").read_lines().dispatch().map(str)
    errors = []
    for mode in MODES:
        with pytest.raises(cp.PipelineError) as info:
            cp.Loader(pipe, _config(mode, num_workers=0))
        errors.append(str(info.value))
    assert errors[0] == errors[1]


@pytest.mark.parametrize(
    "value", ["nodes", "services", 1, None], ids=["plural", "misspelt", "int", "none"]
)
def test_central_must_be_a_known_mode(value: Any) -> None:
    """``central`` outside ``"process"``/``"service"``/``"node"`` is a
    ``ConfigError`` naming the field and the choices."""
    with pytest.raises(cp.ConfigError, match=r"`central`.*'process', 'service', 'node'"):
        cp.LoaderConfig(central=value)


def test_central_round_trips_through_a_dict() -> None:
    """``central`` is in ``to_dict()`` and read back by ``from_dict()``; the default is process."""
    assert cp.LoaderConfig().central == "process"
    config = cp.LoaderConfig(central="service")
    assert config.to_dict()["central"] == "service"
    assert cp.LoaderConfig.from_dict(config.to_dict()) == config


# -- the rendezvous --------------------------------------------------------------------


@pytest.fixture
def listener(tmp_path: Path) -> Any:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = tmp_path / "s.sock"
    sock.bind(str(path))
    sock.listen(4)
    sock.settimeout(10)
    yield sock, str(path)
    sock.close()


class _Bomb:
    def __reduce__(self) -> Any:
        return (os.mkdir, (os.environ["BOMB_DIR"],))


def _raw_peer(path: str, payload: bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(len(payload).to_bytes(4, "big") + payload)
    return sock


def test_an_unauthenticated_peer_is_refused_without_unpickling(
    listener: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that sends a pickle instead of the greeting is refused; the
    pickle is never loaded (its side effect does not happen)."""
    sock, path = listener
    bomb = tmp_path / "exploded"
    monkeypatch.setenv("BOMB_DIR", str(bomb))
    peer = _raw_peer(path, pickle.dumps(_Bomb()))
    try:
        with pytest.raises(cp.ServiceError, match=r"greeting|broke off"):
            rendezvous.accept(sock, b"t" * 32)
    finally:
        peer.close()
    assert not bomb.exists()


def test_a_silent_peer_is_dropped_after_the_handshake_timeout(
    listener: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that connects and sends nothing is dropped, not waited on."""
    sock, path = listener
    monkeypatch.setattr(timeouts, "HANDSHAKE_TIMEOUT_S", 0.2)
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.connect(path)
    try:
        with pytest.raises(cp.ServiceError, match=r"sent nothing within 0\.2 s"):
            rendezvous.accept(sock, b"t" * 32)
    finally:
        peer.close()


def test_a_wrong_token_is_refused_on_both_sides(listener: Any) -> None:
    """A client with another job's token is refused by the service, and the
    client refuses the service too: neither proves the other's token."""
    sock, path = listener
    errors: list[BaseException] = []

    def client() -> None:
        try:
            rendezvous.connect(path, b"b" * 32).close()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=client)
    thread.start()
    with pytest.raises(cp.ServiceError, match="does not hold this job's token"):
        rendezvous.accept(sock, b"a" * 32)
    thread.join(10)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], cp.ServiceError)


def test_the_right_token_and_credentials_connect(listener: Any) -> None:
    """With the token, both ends authenticate; the kernel's peer credentials
    name this process; an unexpected pid is refused."""
    sock, path = listener
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(rendezvous.connect(path, b"k" * 32)))
    thread.start()
    conn = rendezvous.accept(sock, b"k" * 32, expect_pid=os.getpid())
    thread.join(10)
    conn.send_bytes(b"hi")
    assert out[0].recv_bytes() == b"hi"
    conn.close()
    out[0].close()
    peer = _raw_peer(path, b"")
    try:
        with pytest.raises(cp.ServiceError, match=f"refused a connection from pid {os.getpid()}"):
            rendezvous.accept(sock, b"k" * 32, expect_pid=1)
    finally:
        peer.close()


@pytest.mark.parametrize("mode", [0o755, 0o701], ids=["group-readable", "others-enter"])
def test_a_directory_others_can_enter_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    """The job's directory must be this user's, mode 0700, and not a link."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    made = rendezvous.private_dir("job-x")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    made.chmod(mode)
    with pytest.raises(cp.ServiceError, match="mode 0700"):
        rendezvous.private_dir("job-x")
    made.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    made.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(cp.ServiceError, match="must be a directory"):
        rendezvous.private_dir("job-x")
