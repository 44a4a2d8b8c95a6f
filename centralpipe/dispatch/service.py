"""``central="service"``: the Loader's central part in one helper process (its side).

The helper (the *service*) runs a
:class:`~centralpipe.dispatch.local.LocalCentral` (the central stages, the
dispatch and the worker pool; its workers are its own children), so the
central chain's CPU time and GIL are not the training loop's. The training
process keeps a :class:`~centralpipe.dispatch.client.ServiceClient`, the same
surface as ``LocalCentral``: each call is one request and one reply.

- **Finding and trusting it**: the service listens on a Unix socket in this
  user's ``0700`` directory of the job, and the client connects with the
  per-Loader token and peer credentials (:mod:`centralpipe.dispatch.rendezvous`);
  nothing is unpickled before both sides authenticated. Once its client is
  connected the service removes the socket (and the directory, if empty):
  nothing else can connect, and nothing is left on disk however either side
  ends.
- **Outputs**: one reply per output, pulled from the service's pass only when
  the client asks. As it hands an output to its consumer the client asks
  for the next one *ahead* (``ahead``), so that it crosses while the
  training step runs; the service delivers it only if it is ready in a chunk
  without failures (else it replies ``none`` and the client's next ``next``
  waits as before). While the client holds such an output unread, the
  service answers every other request one output back
  (``LocalCentral.step_back``/``step_to``: the stream's delivery position is stepped
  back and forward again, nothing is run twice), and a request that ends the
  pass steps it back for good: ``state()``, ``query(delivered=True)`` and
  the rest are exactly the consumer's position. Large tensors and arrays
  cross in a shared-memory ring
  (:mod:`centralpipe.dispatch.wire.ringreader`, the one the workers use: anonymous
  memory, nothing in ``/dev/shm``) and are lent to the consumer without a
  copy; the client does no per-item work beyond receiving its output.
- **Faults**: every wait of the client is on the connection *and* the
  service's process sentinel, so a killed service is a ``ServiceError`` at
  once, never a hang. The service ends when its client closes, when the
  connection ends (the client died: the kernel closes it) or when its watchdog
  sees the client gone; its workers notice the service gone on their own.
  Ctrl-C reaches the service too (one process group) and is ignored there: the
  client decides, as the main process does for its workers.
- **Priority**: the service and its workers run ``priority.NICENESS`` points
  nicer than the training process, and the service switches threads on a
  short GIL interval (:mod:`centralpipe.dispatch.priority`): on a machine
  with few cores the training loop's Python goes first.
- **Threads**: requests take turns on the first connection; ``metrics()`` and
  ``worker_pids()``, which never wait in any mode, go on a second one that a
  thread of the service answers, so they are not queued behind a ``next()``.
  The service's GIL switch interval is
  :data:`~centralpipe.dispatch.timeouts.SERVICE_SWITCH_INTERVAL_S` (0.2 ms,
  not Python's 5 ms), so a thread woken by a request does not wait
  milliseconds for the GIL while the feeder runs the central chain.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch

from centralpipe.config import LoaderConfig
from centralpipe.dispatch import priority, rendezvous, timeouts
from centralpipe.dispatch.local import LocalCentral
from centralpipe.dispatch.wire import transport
from centralpipe.dispatch.wire.ringwriter import RingWriter, receive_ring
from centralpipe.dispatch.worker.loop import main_alive
from centralpipe.errors import ServiceError
from centralpipe.plan.pipeline import Pipeline

__all__ = ["ENDS_A_PASS", "Server", "serve"]


_SUPERSEDED = (
    "this iterator was superseded: iter(loader), load_state_dict() or close() "
    "was called since it started; iterate the loader again."
)


def _watchdog(client_pid: int, parent_pid: int) -> None:
    """End the service once its client is gone (dead, even unreaped, or the
    service re-parented), even inside a central ``next()``: its workers then
    see it gone and end too."""
    while True:
        time.sleep(timeouts.SERVICE_WATCHDOG_S)
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
    priority.lower_helper()  # before its workers start: they inherit it
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
        if with_ring:  # the first thing on the connection (see wire.ringreader)
            ring = receive_ring(conn)
        Server(conn, ring).run(pipeline, config, control)
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
        listener.settimeout(timeouts.ACCEPT_TIMEOUT_S)
        ready.send_bytes(b"ready")
        ready.close()
        deadline = time.monotonic() + timeouts.ACCEPT_TIMEOUT_S
        while len(conns) < 2 and time.monotonic() < deadline:
            try:
                conns.append(rendezvous.accept(listener, token, expect_pid=client_pid))
            except ServiceError:
                continue  # not our client: refused, keep waiting for it
            except (TimeoutError, OSError):
                break
    finally:
        listener.close()
        rendezvous.remove_socket(path)
    if len(conns) < 2:
        for c in conns:
            c.close()
        return None
    return conns[0], conns[1]


class Server:
    """The service's request loop over one authenticated connection."""

    def __init__(self, conn: Connection, ring: RingWriter | None) -> None:
        self._conn = conn
        self._ring = ring
        self._pass_id = 0
        self._outputs: Iterator[Any] | None = None
        #: The client holds the last output unread: it came from an ``ahead``
        #: request, and no ``next`` or ``ahead`` has followed it yet.
        self._ahead = False
        #: A request is being answered with the position stepped back.
        self._behind = False

    def run(
        self,
        pipeline: Pipeline,
        config: LoaderConfig,
        control: Connection,
        make: Callable[[], LocalCentral] | None = None,
    ) -> None:
        try:
            central = LocalCentral(pipeline, config) if make is None else make()
        except Exception as exc:
            self._reply("err", exc)
            return
        try:
            threading.Thread(
                target=_serve_reads,
                args=(central, control, lambda: self._ahead and not self._behind),
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
                self.handle_request(central, op, args)
        finally:
            central.close()

    def handle_request(self, central: LocalCentral, op: str, args: tuple[Any, ...]) -> None:
        if self._ahead and op not in _DELIVERIES:
            # Whatever the request, it is answered at the client's position.
            try:
                position = central.step_back()
            except Exception as exc:  # never expected: nothing to step back
                self._reply("err", exc)
                return
            if op in ENDS_A_PASS:
                self._ahead = False  # the output is dropped with the pass
            else:
                self._behind = True
                try:
                    self._handle(central, op, args)
                finally:
                    central.step_to(position)  # delivered again: the client has it
                    self._behind = False
                return
        self._handle(central, op, args)

    def _handle(self, central: LocalCentral, op: str, args: tuple[Any, ...]) -> None:
        value: Any = None
        try:
            if op in _DELIVERIES:
                if args[0] != self._pass_id or self._outputs is None:
                    raise RuntimeError(_SUPERSEDED)
                # The client read every output before this request.
                self._ahead = False
                if op == "ahead" and not central.ready_ahead():
                    self._reply("none", None)
                    return
                try:
                    value = self._outputs.__next__()
                except StopIteration:
                    self._reply("end", None)
                    return
                self._ahead = op == "ahead"
            elif op == "start":
                self._outputs = None
                self._outputs = central.start()
                self._pass_id += 1
                value = (self._pass_id, central.epoch)
            elif op == "stop":
                self._outputs = None
                central.stop()
            elif op == "load":
                central.load(state_from_bytes(args[0]))
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
        if not self._reply("ok", value):
            # The output went as an error in its place: the client raises it
            # there, as delivered (the pass goes on after it), not held.
            self._ahead = False

    def _reply(self, kind: str, value: Any) -> bool:
        """Send one reply; ``False`` if ``value`` could not be pickled and an
        error naming it went instead."""
        sent = True
        try:
            msg = transport.dumps((kind, value))
        except Exception as exc:  # e.g. an exception or output that cannot be pickled
            what = f"{type(value).__name__}: {value}" if kind == "err" else type(value).__name__
            err = RuntimeError(
                f"the central service could not send a reply ({what}): "
                f"{transport.exception_text(exc)}; make it picklable."
            )
            msg = transport.dumps(("err", err))
            sent = False
        transport.write(self._conn, msg, self._ring)
        return sent


def state_to_bytes(state_dict: Any) -> bytes:
    """A state as ``load`` requests carry it: ``torch.save``'s bytes. A
    connection's own pickling would share its tensors through file
    descriptors, which only a process of this one's family may fetch (another
    local rank of ``central="node"`` is refused), and plain pickle cannot
    write ``uint16`` tensors (compact token data)."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    return buf.getvalue()


def state_from_bytes(data: bytes) -> Any:
    """The state :func:`state_to_bytes` wrote (from an authenticated client of
    this user: its in-flight items may be any picklable objects)."""
    return torch.load(io.BytesIO(data), weights_only=False)


_READS = ("state", "total", "length", "worker_states")
#: Requests for the pass's next output: ``next`` waits for it; ``ahead``,
#: sent by the client as it hands an output to its consumer, takes it only
#: if it is there now and can be stepped back (else the reply is ``none``).
_DELIVERIES = ("next", "ahead")
#: Requests that end the pass: an output the client holds unread (or kept
#: from a cut-short call) is dropped, on both sides.
ENDS_A_PASS = ("start", "stop", "load", "set_next_epoch")
#: Reads that never wait (``LocalCentral`` answers them from any thread): served
#: on their own connection, so they are not queued behind a ``next()``.
_NEVER_WAIT = ("metrics", "worker_pids")


def _serve_reads(central: LocalCentral, conn: Connection, ahead: Callable[[], bool]) -> None:
    """The service's second connection: ``_NEVER_WAIT`` reads, in a thread.
    ``metrics()`` counts an output the client holds unread (``ahead()``) as
    buffered, not delivered, as the client's consumer sees it."""
    with contextlib.suppress(EOFError, OSError):
        while True:
            op, _ = conn.recv()
            try:
                if op not in _NEVER_WAIT:
                    raise ValueError(f"unknown read {op!r}")
                value = getattr(central, op)()
                if op == "metrics" and ahead():
                    d = value["dispatch"]
                    d["delivered"], d["buffered"] = d["delivered"] - 1, d["buffered"] + 1
                reply: tuple[str, Any] = ("ok", value)
            except Exception as exc:
                reply = ("err", exc)
            transport.send(conn, reply)
