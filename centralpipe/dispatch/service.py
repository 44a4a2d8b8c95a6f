"""``central="service"``: the Loader's central part in one helper process.

The helper (the *service*) runs a
:class:`~centralpipe.dispatch.local.LocalCentral` (the central stages, the
dispatch and the worker pool; its workers are its own children), so the
central chain's CPU time and GIL are not the training loop's. The training
process keeps a :class:`ServiceClient`, the same surface as ``LocalCentral``:
each call is one request and one reply on one connection.

- **Finding and trusting it**: the service listens on a Unix socket in this
  user's ``0700`` directory of the job, and the client connects with the
  per-Loader token and peer credentials (:mod:`centralpipe.dispatch.rendezvous`);
  nothing is unpickled before both sides authenticated. Once its client is
  connected the service removes the socket (and the directory, if empty):
  nothing else can connect, and nothing is left on disk however either side
  ends.
- **Outputs**: one reply per output, pulled from the service's pass only when
  the client asks, so the service's delivery position is the consumer's and
  ``state()`` is exact. Large tensors and arrays cross in a shared-memory ring
  (:mod:`centralpipe.dispatch.wire.shm`, the one the workers use: anonymous
  memory, nothing in ``/dev/shm``) and are lent to the consumer without a
  copy; the client does no per-item work beyond receiving its output.
- **Faults**: every wait of the client is on the connection *and* the
  service's process sentinel, so a killed service is a ``ServiceError`` at
  once, never a hang. The service ends when its client closes, when the
  connection ends (the client died: the kernel closes it) or when its watchdog
  sees the client gone; its workers notice the service gone on their own.
  Ctrl-C reaches the service too (one process group) and is ignored there: the
  client decides, as the main process does for its workers.
- **Threads**: requests take turns on the first connection; ``metrics()`` and
  ``worker_pids()``, which never wait in any mode, go on a second one that a
  thread of the service answers, so they are not queued behind a ``next()``.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import multiprocessing
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

import attrs

from centralpipe.config import LoaderConfig
from centralpipe.dispatch import rendezvous
from centralpipe.dispatch.local import LocalCentral
from centralpipe.dispatch.pinning import Pinner, make_pinner
from centralpipe.dispatch.wire import shm, transport
from centralpipe.dispatch.wire.stash import RingWriter, receive_ring
from centralpipe.dispatch.worker.loop import main_alive
from centralpipe.errors import PipelineError, ServiceError
from centralpipe.plan.pipeline import Pipeline
from centralpipe.stages.totals import Total

__all__ = ["CLOSE_TIMEOUT_S", "POLL_S", "START_TIMEOUT_S", "ServiceClient", "serve"]

#: Longest wait for the service to start and build the pipeline's stages.
START_TIMEOUT_S = 120.0
#: Longest wait for the service to exit once asked to, before it is killed.
CLOSE_TIMEOUT_S = 10.0
#: How often the client's waits and the service's watchdog re-check liveness.
POLL_S = 0.5
#: How long the service waits for its client to connect.
ACCEPT_TIMEOUT_S = 60.0

_IDS = itertools.count()
#: Requests whose reply a cut-short call keeps for the same request next
#: (``ServiceClient._drain``): an output, a started pass.
_KEPT = ("next", "start")
#: Requests after which such a kept reply is void.
_ENDS_A_PASS = ("start", "stop", "load", "set_next_epoch")
_SUPERSEDED = (
    "this iterator was superseded: iter(loader), load_state_dict() or close() "
    "was called since it started; iterate the loader again."
)


# -- the service (helper process) ---------------------------------------------------


def _watchdog(client_pid: int, parent_pid: int) -> None:
    """End the service once its client is gone (dead, even unreaped, or the
    service re-parented), even inside a central ``next()``: its workers then
    see it gone and end too."""
    while True:
        time.sleep(POLL_S)
        if os.getppid() != parent_pid or not main_alive(client_pid):
            os._exit(0)


def serve(
    pipeline: Pipeline,
    config: LoaderConfig,
    path: str,
    token: bytes,
    client_pid: int,
    ready: Connection,
    with_ring: bool,
) -> None:
    """Entry point of the service process (a ``multiprocessing.Process`` target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(
        target=_watchdog,
        args=(client_pid, os.getppid()),
        name="centralpipe-service-watchdog",
        daemon=True,
    ).start()
    conns = _clients(path, token, client_pid, ready)
    if conns is None:
        return
    conn, control = conns
    ring: RingWriter | None = None
    try:
        if with_ring:  # the first thing on the connection (see wire.shm)
            ring = receive_ring(conn)
        _Server(conn, ring).run(pipeline, config, control)
    except (EOFError, OSError):  # the client went away
        pass
    finally:
        conn.close()
        control.close()


def _clients(
    path: str, token: bytes, client_pid: int, ready: Connection
) -> tuple[Connection, Connection] | None:
    """Listen at ``path`` until the client has authenticated its two
    connections (requests, then reads that never wait); then remove the
    socket (and its directory when empty). Peers that fail to authenticate
    are dropped and the wait goes on; ``None`` if the client never comes."""
    conns: list[Connection] = []
    listener = rendezvous.listen(path)
    try:
        listener.settimeout(ACCEPT_TIMEOUT_S)
        ready.send_bytes(b"ready")
        ready.close()
        deadline = time.monotonic() + ACCEPT_TIMEOUT_S
        while len(conns) < 2 and time.monotonic() < deadline:
            try:
                conns.append(rendezvous.accept(listener, token, expect_pid=client_pid))
            except ServiceError:
                continue  # not our client: refused, keep waiting for it
            except (TimeoutError, OSError):
                break
    finally:
        listener.close()
        _remove_socket(path)
    if len(conns) < 2:
        for c in conns:
            c.close()
        return None
    return conns[0], conns[1]


def _remove_socket(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))  # only when empty: other Loaders' sockets stay


class _Server:
    """The service's request loop over one authenticated connection."""

    def __init__(self, conn: Connection, ring: RingWriter | None) -> None:
        self._conn = conn
        self._ring = ring
        self._pass_id = 0
        self._outputs: Iterator[Any] | None = None

    def run(self, pipeline: Pipeline, config: LoaderConfig, control: Connection) -> None:
        try:
            central = LocalCentral(pipeline, config)
        except Exception as exc:
            self._reply("err", exc)
            return
        try:
            threading.Thread(
                target=_serve_reads,
                args=(central, control),
                name="centralpipe-service-reads",
                daemon=True,
            ).start()
            self._reply("ok", central.epoch)
            while True:
                op, args = self._conn.recv()
                if op == "close":
                    central.close()
                    self._reply("ok", None)
                    return
                self._handle(central, op, args)
        finally:
            central.close()

    def _handle(self, central: LocalCentral, op: str, args: tuple[Any, ...]) -> None:
        value: Any = None
        try:
            if op == "next":
                if args[0] != self._pass_id or self._outputs is None:
                    raise RuntimeError(_SUPERSEDED)
                try:
                    value = self._outputs.__next__()
                except StopIteration:
                    self._reply("end", None)
                    return
            elif op == "start":
                self._outputs = None
                self._outputs = central.start()
                self._pass_id += 1
                value = (self._pass_id, central.epoch)
            elif op == "stop":
                self._outputs = None
                central.stop()
            elif op == "load":
                central.load(args[0])
                value = central.epoch
            elif op == "set_next_epoch":
                self._outputs = None
                central.set_next_epoch(args[0])
                value = central.epoch
            elif op == "query":
                value = central.query(args[0], delivered=args[1])
            elif op in _READS:
                value = getattr(central, op)(*args)
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception as exc:
            self._reply("err", exc)
            return
        self._reply("ok", value)

    def _reply(self, kind: str, value: Any) -> None:
        try:
            msg = transport.dumps((kind, value))
        except Exception as exc:  # e.g. an exception or output that cannot be pickled
            what = f"{type(value).__name__}: {value}" if kind == "err" else type(value).__name__
            err = RuntimeError(
                f"the central service could not send a reply ({what}): "
                f"{transport.exception_text(exc)}; make it picklable."
            )
            msg = transport.dumps(("err", err))
        transport.write(self._conn, msg, self._ring)


_READS = ("state", "total", "length", "worker_states")
#: Reads that never wait (``LocalCentral`` answers them from any thread): served
#: on their own connection, so they are not queued behind a ``next()``.
_NEVER_WAIT = ("metrics", "worker_pids")


def _serve_reads(central: LocalCentral, conn: Connection) -> None:
    """The service's second connection: ``_NEVER_WAIT`` reads, in a thread."""
    with contextlib.suppress(EOFError, OSError):
        while True:
            op, _ = conn.recv()
            try:
                if op not in _NEVER_WAIT:
                    raise ValueError(f"unknown read {op!r}")
                reply: tuple[str, Any] = ("ok", getattr(central, op)())
            except Exception as exc:
                reply = ("err", exc)
            transport.send(conn, reply)


# -- the client (training process) --------------------------------------------------


@attrs.define
class _Link:
    """What the client's finalizer releases (apart from the client)."""

    proc: Any
    path: str
    conn: Connection | None = None
    control: Connection | None = None
    ring: shm.Ring | None = None
    pinner: Pinner | None = None
    exit_hook: Any = None


def _shutdown(link: _Link) -> None:
    """Ask the service to end, wait (bounded), then terminate and kill; close
    the connection, the ring and the pin thread. Takes no lock; idempotent."""
    proc, conn = link.proc, link.conn
    if proc.pid is not None:  # started
        if conn is not None:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("close", ()))
            wait([proc.sentinel], CLOSE_TIMEOUT_S)
        proc.join(0.1)
        if proc.exitcode is None:
            proc.terminate()
            proc.join(CLOSE_TIMEOUT_S)
        if proc.exitcode is None:  # pragma: no cover - SIGTERM ignored
            proc.kill()
            proc.join()
    if conn is not None:
        conn.close()
        link.conn = None
    if link.control is not None:
        link.control.close()
        link.control = None
    if link.ring is not None:
        link.ring.close()
        link.ring = None
    if link.pinner is not None:
        link.pinner.close()
        link.pinner = None
    _remove_socket(link.path)
    if link.exit_hook is not None:
        atexit.unregister(link.exit_hook)
        link.exit_hook = None


class ServiceClient:
    """The Loader's central part in a helper process; see the module docstring."""

    def __init__(self, pipeline: Pipeline, config: LoaderConfig) -> None:
        method = config.workers.resolved_start_method()
        ctx: Any = multiprocessing.get_context(method)
        directory = rendezvous.private_dir(rendezvous.job_key())
        path = str(directory / f"loader-{os.getpid()}-{next(_IDS)}.sock")
        token = rendezvous.new_token()
        inner = attrs.evolve(config, central="process", pin_memory=False)
        with_ring = shm.available()
        ready_r, ready_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=serve,
            args=(pipeline, inner, path, token, os.getpid(), ready_w, with_ring),
            name="centralpipe-service",
        )
        link = self._link = _Link(proc=proc, path=path)
        self._epoch = 0
        self._dead: str | None = None
        #: Requests sent whose replies are not read yet, oldest first (more
        #: than the current one only after an interrupt cut a call short).
        self._owed: collections.deque[tuple[str, tuple[Any, ...]]] = collections.deque()
        #: The reply of a cut-short ``next`` or ``start``, for the same request next.
        self._held: tuple[tuple[str, tuple[Any, ...]], tuple[str, Any]] | None = None
        self._lock = threading.Lock()
        self._reads_lock = threading.Lock()
        try:
            try:
                proc.start()
            except Exception as exc:
                msg = (
                    f"central='service' with start method {method!r} pickles the pipeline "
                    f"to send it to the service, and that failed: {exc}. Define its "
                    "functions at module level, or use WorkerConfig(start_method='fork')."
                )
                raise PipelineError(msg) from exc
            finally:
                ready_w.close()
            self._finalizer = weakref.finalize(self, _shutdown, link)
            link.exit_hook = self._finalizer
            # Before multiprocessing's own exit hook (which joins this process).
            atexit.register(self._finalizer)
            try:
                if not wait([ready_r, proc.sentinel], START_TIMEOUT_S) or not ready_r.poll():
                    self._died("while starting")
            finally:
                ready_r.close()
            link.conn = rendezvous.connect(path, token, expect_pid=proc.pid)
            link.control = rendezvous.connect(path, token, expect_pid=proc.pid)
            if with_ring:
                link.ring = shm.Ring(config.workers.shared_memory_bytes)
                if not link.ring.hand_over(link.conn):
                    self._died("while starting")
            kind, value = self._receive()
            if kind == "err":
                raise value
            self._epoch = value
            link.pinner = make_pinner(config.pin_memory)
        except BaseException:
            _shutdown(link)
            raise

    @property
    def service_pid(self) -> int:
        """The service's process id (e.g. for monitoring)."""
        pid: int = self._link.proc.pid
        return pid

    @property
    def epoch(self) -> int:
        return self._epoch

    # -- requests -------------------------------------------------------------------

    def _died(self, when: str) -> None:
        proc = self._link.proc
        proc.join(0.5)
        code = proc.exitcode
        self._dead = (
            f"the central service of this Loader (pid {proc.pid}) died {when} "
            f"(exit code {code}; negative: killed by that signal). The pass and the "
            "position are lost with it: close this Loader, create a new one and "
            "load_state_dict() the last checkpoint."
        )
        raise ServiceError(self._dead)

    def _receive(
        self, conn: Connection | None = None, ring: shm.Ring | None = None
    ) -> tuple[str, Any]:
        """The next reply, waiting on the connection and the service's sentinel."""
        if conn is None:
            conn, ring = self._link.conn, self._link.ring
        assert conn is not None
        sentinel = self._link.proc.sentinel
        while True:
            ready = wait([conn, sentinel], POLL_S)  # where an interrupt lands, harmlessly
            if conn in ready:
                break
            if ready:
                self._died("during a request")
        try:
            reply: tuple[str, Any] = transport.recv(conn, ring)
        except (EOFError, OSError):
            self._died("during a request")
        except BaseException:
            # Cut short inside one message (Ctrl-C): the connection is out of
            # step and cannot be read again.
            self._dead = (
                "an interrupt cut a reply of the central service in half; this Loader "
                "cannot go on: close it, create a new one and load_state_dict() the "
                "last checkpoint."
            )
            raise
        return reply

    def _drain(self) -> None:
        """Read the replies owed to calls that an interrupt cut short; an
        owed ``next`` keeps its output for the pass's next ``next()``, an owed
        ``start`` its pass for the next ``start()`` (the service started it:
        starting again would skip an epoch)."""
        while self._owed:
            op, args = self._owed[0]
            reply = self._receive()
            self._owed.popleft()  # no call between the reply and its record
            if op in _KEPT and reply[0] != "err":
                self._held = ((op, args), reply)

    def _call(self, op: str, *args: Any) -> tuple[str, Any]:
        """One request and its reply ``(kind, value)``; an error reply is raised.
        Calls from several threads take turns (one connection)."""
        with self._lock:
            return self._call_locked(op, args)

    def _call_locked(self, op: str, args: tuple[Any, ...]) -> tuple[str, Any]:
        if self._dead is not None:
            raise ServiceError(self._dead)
        conn = self._link.conn
        if conn is None:
            raise RuntimeError("this Loader is closed.")
        self._drain()
        held = self._held
        if held is not None and held[0] == (op, args):
            self._held = None
            return held[1]  # what a cut-short call of the same request was getting
        if op in _ENDS_A_PASS:
            self._held = None
        self._owed.append((op, args))
        try:
            conn.send((op, args))
        except OSError:
            self._owed.pop()
            self._died("before a request")
        kind, value = self._receive()
        self._owed.popleft()
        if kind == "err":
            raise value
        return kind, value

    # -- the surface ----------------------------------------------------------------

    def start(self) -> Iterator[Any]:
        _, (pass_id, epoch) = self._call("start")
        self._epoch = epoch
        return _RemotePass(self, pass_id)

    def next_output(self, pass_id: int) -> Any:
        kind, value = self._call("next", pass_id)
        if kind == "end":
            raise StopIteration
        pinner = self._link.pinner
        if pinner is not None:
            value = pinner.submit([value]).result()[0]
        return value

    def stop(self) -> None:
        self._call("stop")

    def set_next_epoch(self, epoch: int) -> None:
        self._epoch = self._call("set_next_epoch", epoch)[1]

    def state(self, what: str = "state_dict()") -> dict[str, Any]:
        value: dict[str, Any] = self._call("state", what)[1]
        return value

    def load(self, state_dict: dict[str, Any]) -> None:
        self._epoch = self._call("load", state_dict)[1]

    def query(self, name: str, *, delivered: bool = False) -> dict[str, Any]:
        value: dict[str, Any] = self._call("query", name, delivered)[1]
        return value

    def _read(self, op: str) -> Any:
        """A read that never waits, on the second connection (not queued
        behind a request in progress on the first)."""
        with self._reads_lock:
            if self._dead is not None:
                raise ServiceError(self._dead)
            conn = self._link.control
            if conn is None:
                if op == "worker_pids":  # as in process mode: no live worker
                    return []
                raise RuntimeError("this Loader is closed.")
            try:
                conn.send((op, ()))
            except OSError:
                self._died("before a request")
            kind, value = self._receive(conn, None)
        if kind == "err":
            raise value
        return value

    def metrics(self) -> dict[str, Any]:
        value: dict[str, Any] = self._read("metrics")
        return value

    def total(self, stage: str | None = None) -> Total | None:
        value: Total | None = self._call("total", stage)[1]
        return value

    def length(self) -> int:
        value: int = self._call("length")[1]
        return value

    def worker_states(self) -> list[dict[str, Any]]:
        value: list[dict[str, Any]] = self._call("worker_states")[1]
        return value

    def worker_pids(self) -> list[int]:
        value: list[int] = self._read("worker_pids")
        return value

    def close(self) -> None:
        """End the service (bounded) and release the ring; idempotent."""
        self._finalizer()


class _RemotePass(Iterator[Any]):
    """One pass's outputs, pulled from the service one reply at a time."""

    def __init__(self, client: ServiceClient, pass_id: int) -> None:
        self._client = client
        self._pass_id = pass_id

    def __iter__(self) -> _RemotePass:
        return self

    def __next__(self) -> Any:
        return self._client.next_output(self._pass_id)
