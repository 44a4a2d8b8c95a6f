"""``central="service"``: the thin client the Loader keeps in the training process.

:class:`ServiceClient` has the surface of
:class:`~centralpipe.dispatch.local.LocalCentral`; it starts the service
(:func:`centralpipe.dispatch.service.serve`, whose module docstring tells the
whole design), connects twice (requests; reads that never wait), hands it a
shared-memory ring for the outputs, and turns every call into one request
and one reply; ``next()`` also asks for the output after it, which crosses
while the consumer works (see the service's docstring, "Outputs"). Every
wait is on the connection and the service's process
sentinel: a killed service is a ``ServiceError`` at once. A Ctrl-C that cuts
a call short leaves its reply owed: the next call reads it first, and keeps
the output of a ``next`` (or the pass of a ``start``) for the same call.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import multiprocessing
import operator
import os
import struct
import threading
import weakref
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

import attrs

from centralpipe.config import LoaderConfig
from centralpipe.dispatch import rendezvous, timeouts
from centralpipe.dispatch.pinning import Pinner, make_pinner
from centralpipe.dispatch.service import ENDS_A_PASS, serve, state_to_bytes
from centralpipe.dispatch.wire import ringreader, transport
from centralpipe.errors import PipelineError, ServiceError
from centralpipe.plan.pipeline import Pipeline
from centralpipe.stages.totals import Total

__all__ = ["Link", "ServiceClient", "shutdown"]


_IDS = itertools.count()
#: A request this small is one frame written by one ``os.write`` (a socket
#: with room takes it whole), recorded together with its write.
_ONE_WRITE_BYTES = 4096
#: ``multiprocessing.connection``'s frame header: the payload's length.
_FRAME_LEN = struct.Struct("!i")
#: Requests whose reply a cut-short call keeps for the same request next
#: (``ServiceClient._drain``): an output, a started pass.
_KEPT = ("next", "start")


@attrs.define
class Link:
    """What the client's finalizer releases (apart from the client)."""

    proc: Any
    path: str
    conn: Connection | None = None
    control: Connection | None = None
    ring: ringreader.Ring | None = None
    pinner: Pinner | None = None
    exit_hook: Any = None
    #: The client's replies still owed (``ServiceClient._owed``): read before
    #: ``close`` is sent, so that a service writing one is never left blocked.
    owed: Any = None
    #: How long a close waits for the service to end before stopping it.
    close_timeout_s: float = attrs.field(factory=lambda: timeouts.SERVICE_CLOSE_TIMEOUT_S)


def _discard_owed(link: Link) -> None:
    """Read and drop the replies the client still owes itself (an ``ahead``
    above all): a service writing a reply larger than the socket's buffer
    would not read ``close`` until it is read. Bounded; never raises."""
    owed, conn = link.owed, link.conn
    with contextlib.suppress(Exception):
        while owed and conn is not None:
            if not conn.poll(timeouts.SERVICE_CLOSE_TIMEOUT_S):
                return
            transport.recv(conn, link.ring)
            owed.popleft()


def shutdown(link: Link) -> None:
    """Ask the service to end, wait (bounded), then terminate and kill; close
    the connection, the ring and the pin thread. Takes no lock; idempotent."""
    proc, conn = link.proc, link.conn
    _discard_owed(link)
    if proc is None:  # central="node" on a rank that did not start the service
        if conn is not None:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("close", ()))
                conn.poll(timeouts.SERVICE_CLOSE_TIMEOUT_S)
    elif proc.pid is not None:  # started
        if conn is not None:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("close", ()))
            wait([proc.sentinel], link.close_timeout_s)
        proc.join(0.1)
        if proc.exitcode is None:
            proc.terminate()
            proc.join(timeouts.SERVICE_CLOSE_TIMEOUT_S)
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
    rendezvous.remove_socket(link.path)
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
        with_ring = ringreader.available()
        ready_r, ready_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=serve,
            args=(pipeline, inner, path, token, os.getpid(), ready_w, with_ring),
            name="centralpipe-service",
        )
        link = self._link = Link(proc=proc, path=path)
        self._init_requests()
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
            self._finalizer = weakref.finalize(self, shutdown, link)
            link.exit_hook = self._finalizer
            # Before multiprocessing's own exit hook (which joins this process).
            atexit.register(self._finalizer)
            try:
                if not wait([ready_r, proc.sentinel], timeouts.START_TIMEOUT_S):
                    msg = (
                        f"the central service (pid {proc.pid}) did not start within "
                        f"START_TIMEOUT_S={timeouts.START_TIMEOUT_S} s "
                        "(centralpipe.dispatch.timeouts); it was stopped. Is the machine "
                        "out of memory or processes?"
                    )
                    raise ServiceError(msg)
                if not ready_r.poll():
                    self._died("while starting")
            finally:
                ready_r.close()
            link.conn = rendezvous.connect(path, token, expect_pid=proc.pid)
            link.control = rendezvous.connect(path, token, expect_pid=proc.pid)
            if with_ring:
                link.ring = ringreader.Ring(config.workers.shared_memory_bytes)
                if not link.ring.hand_over(link.conn):
                    self._died("while starting")
            kind, value = self._receive()
            if kind == "err":
                raise value
            self._epoch = value
            link.pinner = make_pinner(config.pin_memory)
        except BaseException:
            shutdown(link)
            raise

    def _init_requests(self) -> None:
        """The bookkeeping of requests and replies (before the first request)."""
        self._service_pid = 0
        self._epoch = 0
        self._dead: str | None = None
        #: Requests sent whose replies are not read yet, oldest first: an
        #: ``ahead``, and more only after an interrupt cut a call short.
        self._owed: collections.deque[tuple[str, tuple[Any, ...]]] = collections.deque()
        self._link.owed = self._owed
        #: The reply of a cut-short ``next`` or ``start``, for the same request next.
        self._held: tuple[tuple[str, tuple[Any, ...]], tuple[str, Any]] | None = None
        #: ``(pass id, reply)`` of an ``ahead`` request: an output the service
        #: delivered ahead (or the error in its place), not handed to the
        #: consumer yet; the service answers every other request as if it
        #: were not delivered.
        self._ahead: tuple[int, tuple[str, Any]] | None = None
        #: ``(pass id, output)`` being handed to the consumer: kept across an
        #: interrupt, so the next ``next()`` hands it out.
        self._ready: tuple[int, Any] | None = None
        self._lock = threading.Lock()
        self._reads_lock = threading.Lock()

    @property
    def service_pid(self) -> int:
        """The service's process id (e.g. for monitoring)."""
        proc = self._link.proc
        pid: int = self._service_pid if proc is None else proc.pid
        return pid

    @property
    def epoch(self) -> int:
        return self._epoch

    # -- requests -------------------------------------------------------------------

    def _died(self, when: str) -> None:
        proc = self._link.proc
        if proc is None:
            what = f"of this node (pid {self._service_pid}) ended {when} (the connection closed)"
        else:
            proc.join(0.5)
            code = proc.exitcode
            what = (
                f"of this Loader (pid {proc.pid}) died {when} "
                f"(exit code {code}; negative: killed by that signal)"
            )
        self._dead = (
            f"the central service {what}. The pass and the position are lost with it: "
            "close this Loader, create a new one and load_state_dict() the last checkpoint."
        )
        raise ServiceError(self._dead)

    def _receive(
        self, conn: Connection | None = None, ring: ringreader.Ring | None = None
    ) -> tuple[str, Any]:
        """The next reply, waiting on the connection and the service's sentinel."""
        if conn is None:
            conn, ring = self._link.conn, self._link.ring
        assert conn is not None
        proc = self._link.proc
        watched = [conn] if proc is None else [conn, proc.sentinel]
        while True:
            ready = wait(watched, timeouts.SERVICE_POLL_S)  # where an interrupt lands, harmlessly
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

    def _drain(self, keep: int = 0) -> None:
        """Read the replies owed to calls that an interrupt cut short (and to
        ``ahead`` requests), all but the last ``keep``; an owed ``next``
        keeps its output for the pass's next ``next()``, an owed ``start``
        its pass for the next ``start()`` (the service started it: starting
        again would skip an epoch), an ``ahead`` its output."""
        while len(self._owed) > keep:
            op, args = self._owed[0]
            reply = self._receive()
            # Recorded before the popleft (a C call, after which an interrupt
            # may land): a reply is never read and then lost.
            if op == "ahead":
                if reply[0] != "none":
                    self._ahead = (args[0], reply)
            elif op in _KEPT and reply[0] != "err":
                self._held = ((op, args), reply)
            self._owed.popleft()

    def _call(self, op: str, *args: Any) -> tuple[str, Any]:
        """One request and its reply ``(kind, value)``; an error reply is raised.
        Calls from several threads take turns (one connection)."""
        with self._lock:
            return self._call_locked(op, args)

    def _call_locked(self, op: str, args: tuple[Any, ...]) -> tuple[str, Any]:
        self._check_live()
        owed = self._owed
        if (
            owed
            and self._held is None
            and op not in ENDS_A_PASS
            and all(o == "ahead" for o, _ in owed)
        ):
            # The request goes out at once, behind the ``ahead`` still owed:
            # the service answers both in order (this one at the consumer's
            # position), and one wait covers the two replies.
            self._send(op, args)
            self._drain(keep=1)
        else:
            self._drain()
            held = self._held
            if held is not None and held[0] == (op, args):
                self._held = None
                return held[1]  # what a cut-short call of the same request was getting
            if op in ENDS_A_PASS:
                self._held = self._ahead = self._ready = None
            self._send(op, args)
        reply = self._receive()
        if op in _KEPT:
            # Kept until the popleft has returned (an interrupt there: the
            # next call of the same request gets it).
            self._held = ((op, args), reply)
            self._owed.popleft()
            self._held = None
        else:
            self._owed.popleft()
        kind, value = reply
        if kind == "err":
            raise value
        return kind, value

    # -- the surface ----------------------------------------------------------------

    def start(self) -> Iterator[Any]:
        _, (pass_id, epoch) = self._call("start")
        self._epoch = epoch
        return _RemotePass(self, pass_id)

    def next_output(self, pass_id: int) -> Any:
        with self._lock:
            value = self._next_locked(pass_id)
        pinner = self._link.pinner
        if pinner is not None:
            value = pinner.submit([value]).result()[0]
        return value

    def _next_locked(self, pass_id: int) -> Any:
        """The pass's next output, asking for the one after it before
        handing it out, so that it crosses while the consumer works: an
        ``ahead`` request, which the service answers at once with the output
        it has ready (or ``none``: the next ``next()`` waits for it)."""
        ready = self._ready
        if ready is None or ready[0] != pass_id:
            self._ready = None
            self._drain_live()
            ahead = self._ahead
            if ahead is not None and ahead[0] == pass_id:
                kind, value = ahead[1]
                if kind == "err":  # in the output's place (e.g. it cannot be pickled)
                    self._ahead = None
                    raise value
                self._ready, self._ahead = (pass_id, value), None
            else:
                kind, value = self._call_locked("next", (pass_id,))
                if kind == "end":
                    raise StopIteration
                self._ready = (pass_id, value)
        if self._ahead is None and not self._owed:
            self._send("ahead", (pass_id,))
        ready = self._ready
        assert ready is not None
        self._ready = None  # no call between this and the return
        return ready[1]

    def _check_live(self) -> None:
        """Raise if the service is gone or the Loader closed."""
        if self._dead is not None:
            raise ServiceError(self._dead)
        if self._link.conn is None:
            raise RuntimeError("this Loader is closed.")

    def _drain_live(self) -> None:
        """:meth:`_check_live`, then read the replies still owed (``_drain``)."""
        self._check_live()
        self._drain()

    def _send(self, op: str, args: tuple[Any, ...]) -> None:
        """Send a request whose reply a later call reads (``_drain``).

        Its record in ``_owed`` and its write happen together: a request
        recorded but never written would have the next call wait forever
        for its reply, one written but not recorded would put every later
        reply out of step. A small request (all but ``load``'s state) is
        recorded and written in one C call (no interrupt is handled between
        two steps of one C call); a larger one the usual way."""
        conn = self._link.conn
        assert conn is not None
        entry = (op, args)
        payload = ForkingPickler.dumps(entry)
        if len(payload) > _ONE_WRITE_BYTES:
            self._owed.append(entry)
            try:
                conn.send_bytes(payload)
            except OSError:
                self._owed.pop()
                self._died("before a request")
            return
        frame = _FRAME_LEN.pack(len(payload)) + bytes(payload)
        steps = ((self._owed.append, entry), (os.write, conn.fileno(), frame))
        last: collections.deque[Any] = collections.deque(maxlen=1)
        try:
            last.extend(itertools.starmap(operator.call, steps))
        except BaseException as exc:
            if not last or last[-1] is None:  # the write failed or was cut before a byte
                self._owed.pop()
                if isinstance(exc, OSError):
                    self._died("before a request")
                raise
            # Written; an interrupt handled as the call returned.
            if last[-1] != len(frame):
                self._cut_request()
            raise
        if last[-1] != len(frame):  # a socket short of room took part of it
            try:
                rest = frame[last[-1] :]
                while rest:
                    rest = rest[os.write(conn.fileno(), rest) :]
            except BaseException:
                self._cut_request()
                raise

    def _cut_request(self) -> None:
        """A request was cut in half: the connection is out of step."""
        self._dead = (
            "an interrupt cut a request to the central service in half; this Loader "
            "cannot go on: close it, create a new one and load_state_dict() the "
            "last checkpoint."
        )

    def stop(self) -> None:
        self._call("stop")

    def set_next_epoch(self, epoch: int) -> None:
        self._epoch = self._call("set_next_epoch", epoch)[1]

    def state(self, what: str = "state_dict()") -> dict[str, Any]:
        value: dict[str, Any] = self._call("state", what)[1]
        return value

    def load(self, state_dict: dict[str, Any]) -> None:
        self._epoch = self._call("load", state_to_bytes(state_dict))[1]

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

    def total(self, stage: str | None = None, *, weight: bool = False) -> Total | None:
        value: Total | None = self._call("total", stage, weight)[1]
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
