"""``central="node"``: finding the node's service, its process, and the clients.

Local rank 0's :class:`NodeClient` starts :func:`serve_node` (a helper
process) and leaves its token in the job's ``0700`` directory as a ``0600``
file; the other local ranks' clients read it (:func:`read_token`) and
connect. Each client opens two authenticated connections (requests, with the
shared-memory ring for outputs; reads that never wait) and says which local
rank it is; once every local rank is in, the service removes the socket and
the token and serves each rank in a thread of its own, over the shared
stream of :mod:`centralpipe.dispatch.node` (whose docstring tells the design).
The service ends when every client has closed or died.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing
import os
import signal
import socket
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import attrs

from centralpipe.config import DistributedConfig, LoaderConfig
from centralpipe.dispatch import priority, rendezvous, timeouts
from centralpipe.dispatch.client import Link, ServiceClient, shutdown
from centralpipe.dispatch.local import LocalCentral
from centralpipe.dispatch.node import NodeStream, check_node_pipeline
from centralpipe.dispatch.noderank import RankCentral
from centralpipe.dispatch.pinning import make_pinner
from centralpipe.dispatch.service import Server
from centralpipe.dispatch.wire import ringreader
from centralpipe.dispatch.wire.ringwriter import RingWriter, receive_ring
from centralpipe.dispatch.worker.loop import main_alive
from centralpipe.errors import PipelineError, ServiceError
from centralpipe.plan.pipeline import Pipeline

__all__ = [
    "NodeClient",
    "local_ranks",
    "read_token",
    "serve_node",
    "socket_path",
    "token_path",
    "write_token",
]


def local_ranks() -> tuple[int, int]:
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)`` from the launcher (``(0, 1)`` if unset)."""
    try:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError as exc:
        raise ServiceError(
            f"central='node' needs integer LOCAL_RANK and LOCAL_WORLD_SIZE, got {exc}."
        ) from None
    if per_node < 1 or not 0 <= local < per_node:
        raise ServiceError(
            f"central='node' needs 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE, got LOCAL_RANK={local}, "
            f"LOCAL_WORLD_SIZE={per_node}."
        )
    return local, per_node


def token_path(directory: Path, k: int) -> Path:
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return directory / f"node-{rendezvous.job_key()}-{restart}-{k}.token"


def socket_path(directory: Path, k: int) -> Path:
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return directory / f"node-{restart}-{k}.sock"


def write_token(path: Path, token: bytes) -> None:
    """``token`` at ``path``, readable by this user only (replacing a stale one)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, token)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_token(path: Path, timeout_s: float) -> bytes:
    """The token at ``path`` once it exists (``ServiceError`` after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"no central service of this node appeared at {str(path.parent)!r} within "
                    f"{timeout_s} s: local rank 0 must create a Loader with central='node' too "
                    "(the local ranks build their node-mode Loaders in the same order)."
                ) from None
            time.sleep(0.05)
            continue
        try:
            info = os.fstat(fd)
            if info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise ServiceError(
                    f"the node service's token {str(path)!r} must be a file of user "
                    f"{os.getuid()} with mode 0600: remove it."
                )
            data = os.read(fd, rendezvous.TOKEN_BYTES + 1)
        finally:
            os.close(fd)
        if len(data) == rendezvous.TOKEN_BYTES:
            return data
        if time.monotonic() > deadline:
            raise ServiceError(f"the node service's token {str(path)!r} is damaged: remove it.")
        time.sleep(0.05)


def _watchdog(stream_pids: list[int], ready: threading.Event) -> None:
    """End the service once every client is gone (dead, even unreaped)."""
    while True:
        time.sleep(timeouts.SERVICE_WATCHDOG_S)
        if ready.is_set() and not any(p and main_alive(p) for p in stream_pids):
            os._exit(0)


def serve_node(
    pipeline: Pipeline,
    config: LoaderConfig,
    path: str,
    token: bytes,
    token_file: str,
    owner_pid: int,
    ready: Connection,
    local_world: int,
) -> None:
    """Entry point of the node service (a ``multiprocessing.Process`` target)."""
    priority.lower_helper()  # before its workers start: they inherit it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pids = [owner_pid] * local_world
    connected = threading.Event()
    threading.Thread(
        target=_watchdog, args=(pids, connected), daemon=True, name="centralpipe-node-watchdog"
    ).start()
    links = _accept_all(path, token, token_file, ready, local_world)
    if links is None:
        return
    for rank, (_, _, pid, _) in links.items():
        pids[rank] = pid
    connected.set()
    base = config.distributed.rank
    stream: NodeStream | None = None
    try:
        stream = NodeStream(pipeline, config, local_world)
    except Exception as exc:
        failure: Exception | None = exc
    else:
        failure = None
        stream.pids = list(pids)
    share = max(1, config.workers.num_workers // local_world) if config.workers.num_workers else 0
    # Every rank's central part first, then the requests: a rank that reads
    # at once must find the others' shards there (the window keeps their
    # items), however the threads are scheduled.
    built: dict[int, LocalCentral | Exception] = {}
    configs: dict[int, LoaderConfig] = {}
    for rank in links:
        dist = DistributedConfig(rank=base + rank, world_size=config.distributed.world_size)
        inner = attrs.evolve(
            config,
            central="process",
            pin_memory=False,
            distributed=dist,
            workers=attrs.evolve(config.workers, num_workers=share),
        )
        configs[rank] = inner
        try:
            if failure is not None:
                raise failure
            assert stream is not None
            built[rank] = RankCentral(pipeline, inner, stream, rank)
        except Exception as exc:
            built[rank] = exc
    threads = []
    for rank, (conn, control, _pid, ring) in links.items():
        t = threading.Thread(
            target=_serve_rank,
            args=(pipeline, configs[rank], built[rank], stream, rank, conn, control, ring),
            name=f"centralpipe-node-rank{rank}",
            daemon=True,
        )
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    for central in built.values():
        if not isinstance(central, Exception):
            central.close()
    if stream is not None:
        stream.release()


def _serve_rank(
    pipeline: Pipeline,
    config: LoaderConfig,
    built: LocalCentral | Exception,
    stream: NodeStream | None,
    rank: int,
    conn: Connection,
    control: Connection,
    ring: RingWriter | None,
) -> None:
    clean = False

    def make() -> LocalCentral:
        if isinstance(built, Exception):
            raise built
        return built

    server = _NodeServer(conn, ring, stream)
    try:
        server.run(pipeline, config, control, make)
        clean = True
    except (EOFError, OSError):
        pass
    finally:
        if stream is not None:
            stream.mark_gone(rank, clean)
        conn.close()
        control.close()


class _NodeServer(Server):
    """A rank's request loop; every request fails once the node is broken."""

    def __init__(
        self, conn: Connection, ring: RingWriter | None, stream: NodeStream | None
    ) -> None:
        super().__init__(conn, ring)
        self._stream = stream

    def handle_request(self, central: LocalCentral, op: str, args: tuple[Any, ...]) -> None:
        stream = self._stream
        if stream is not None and stream.broken is not None and op != "metrics":
            self._reply("err", ServiceError(stream.broken))
            return
        super().handle_request(central, op, args)


def _accept_all(
    path: str, token: bytes, token_file: str, ready: Connection, local_world: int
) -> dict[int, tuple[Connection, Connection, int, RingWriter | None]] | None:
    """Every local rank's two authenticated connections, keyed by local rank."""
    found: dict[int, dict[str, Any]] = {}
    listener = rendezvous.listen(path)
    try:
        listener.settimeout(timeouts.ACCEPT_TIMEOUT_S)
        write_token(Path(token_file), token)
        ready.send_bytes(b"ready")
        ready.close()
        deadline = time.monotonic() + timeouts.ACCEPT_TIMEOUT_S
        while not _complete(found, local_world) and time.monotonic() < deadline:
            try:
                conn = rendezvous.accept(listener, token)
            except ServiceError:
                continue
            except (TimeoutError, OSError):
                break
            if not conn.poll(timeouts.HANDSHAKE_TIMEOUT_S):
                conn.close()
                continue
            kind, rank, pid, with_ring = conn.recv()
            entry = found.setdefault(int(rank), {})
            entry["pid"] = int(pid)
            entry[kind] = conn
            if kind == "requests":
                entry["ring"] = receive_ring(conn) if with_ring else None
    finally:
        listener.close()
        rendezvous.remove_socket(path)
        with contextlib.suppress(OSError):
            os.unlink(token_file)
    complete = {
        r: (e["requests"], e["reads"], e["pid"], e.get("ring"))
        for r, e in found.items()
        if "requests" in e and "reads" in e and 0 <= r < local_world
    }
    if len(complete) < local_world:
        for e in found.values():
            for key in ("requests", "reads"):
                if key in e:
                    e[key].close()
        return None
    return complete


def _complete(found: dict[int, dict[str, Any]], local_world: int) -> bool:
    return all(
        "requests" in found.get(r, {}) and "reads" in found.get(r, {}) for r in range(local_world)
    )


_IDS = itertools.count()


class NodeClient(ServiceClient):
    """A local rank's client of its node's service (local rank 0 starts it)."""

    def __init__(self, pipeline: Pipeline, config: LoaderConfig) -> None:
        check_node_pipeline(pipeline)
        local, per_node = local_ranks()
        dist = config.distributed
        if dist.world_size % per_node or dist.rank % per_node != local:
            raise ServiceError(
                f"central='node' needs global rank = node * LOCAL_WORLD_SIZE + LOCAL_RANK "
                f"(torchrun's layout); got rank {dist.rank} of {dist.world_size} with "
                f"LOCAL_RANK={local}, LOCAL_WORLD_SIZE={per_node}."
            )
        k = next(_IDS)
        directory = rendezvous.private_dir(rendezvous.job_key())
        path = str(socket_path(directory, k))
        tpath = token_path(directory, k)
        with_ring = ringreader.available()
        proc: Any = None
        if local == 0:
            method = config.workers.resolved_start_method()
            ctx: Any = multiprocessing.get_context(method)
            token = rendezvous.new_token()
            inner = attrs.evolve(config, central="process", pin_memory=False)
            ready_r, ready_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=serve_node,
                args=(pipeline, inner, path, token, str(tpath), os.getpid(), ready_w, per_node),
                name="centralpipe-node-service",
            )
        link = self._link = Link(proc=proc, path=path if local == 0 else "")
        self._init_requests()
        link.close_timeout_s = timeouts.STALL_TIMEOUT_S
        try:
            if proc is not None:
                try:
                    proc.start()
                except Exception as exc:
                    raise PipelineError(
                        f"central='node' with start method {method!r} pickles the pipeline to "
                        f"send it to the service, and that failed: {exc}. Define its functions "
                        "at module level, or use WorkerConfig(start_method='fork')."
                    ) from exc
                finally:
                    ready_w.close()
            self._finalizer = weakref.finalize(self, shutdown, link)
            link.exit_hook = self._finalizer
            atexit.register(self._finalizer)
            if proc is not None:
                try:
                    if not wait([ready_r, proc.sentinel], timeouts.START_TIMEOUT_S):
                        raise ServiceError(
                            f"the node's central service (pid {proc.pid}) did not start within "
                            f"{timeouts.START_TIMEOUT_S} s."
                        )
                    if not ready_r.poll():
                        self._died("while starting")
                finally:
                    ready_r.close()
                self._service_pid = proc.pid
            else:
                token = read_token(tpath, timeouts.FIND_TIMEOUT_S)
            link.conn = self._connect(path, token, proc, "requests", local, with_ring)
            if with_ring:
                link.ring = ringreader.Ring(config.workers.shared_memory_bytes)
                if not link.ring.hand_over(link.conn):
                    self._died("while starting")
            link.control = self._connect(path, token, proc, "reads", local, False)
            kind, value = self._receive()
            if kind == "err":
                raise value
            self._epoch = value
            link.pinner = make_pinner(config.pin_memory)
        except BaseException:
            shutdown(link)
            raise

    def _connect(
        self, path: str, token: bytes, proc: Any, kind: str, local: int, with_ring: bool
    ) -> Connection:
        deadline = time.monotonic() + timeouts.FIND_TIMEOUT_S
        while True:
            try:
                conn = rendezvous.connect(
                    path, token, expect_pid=None if proc is None else proc.pid
                )
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise ServiceError(
                        f"could not connect to the node's central service at {path!r} within "
                        f"{timeouts.FIND_TIMEOUT_S} s."
                    ) from None
                time.sleep(0.05)
        with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            self._service_pid = rendezvous.peer_credentials(sock)[0]
        conn.send((kind, local, os.getpid(), with_ring))
        return conn
