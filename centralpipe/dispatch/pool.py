"""The executors: where worker stages run — processes or threads.

An :class:`Executor` owns ``num_workers`` *slots*; each slot has one worker
(a process with a duplex pipe, or a thread with an inbox queue), a send lock
and a shared status array (see :mod:`centralpipe.dispatch.protocol`). The
supervisor talks to both kinds through the same few calls: ``send`` (blocking,
by the sending thread only), ``wait`` (by the supervisor thread only),
``replace``, ``kill`` and ``close``.

Shutdown of processes escalates: close our pipe ends (a worker reading gets
EOF, one writing gets EPIPE) → join → terminate → kill, each bounded. Threads
cannot be killed: they get an end-of-input marker and are joined briefly; a
thread stuck in user code is left behind as a daemon thread.
"""

from __future__ import annotations

import abc
import mmap
import multiprocessing as mp
import os
import queue
import threading
import types
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, NamedTuple

from centralpipe.dispatch import protocol, shm
from centralpipe.dispatch.budget import estimate_nbytes
from centralpipe.dispatch.protocol import (
    MSG_RESULT,
    MSG_STATES,
    STATUS_LEN,
    STATUS_READY,
    Encoded,
    read_status,
)
from centralpipe.dispatch.worker import WorkerSpec, serve, worker_main

__all__ = ["Event", "Executor", "ProcessPool", "Slot", "ThreadPool", "describe_exit", "warm_up"]

_JOIN_TIMEOUT_S = 2.0
_TERMINATE_TIMEOUT_S = 1.0
_KILL_TIMEOUT_S = 5.0
_THREAD_JOIN_TIMEOUT_S = 1.0
#: How often a paused worker thread re-checks whether it may hand over its result.
_PAUSE_POLL_S = 0.1
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
#: What the forkserver imports once, before it forks any worker, unless told
#: otherwise: the worker loop (torch-free; see dispatch.preload). The user's
#: stage functions are imported by each worker; their modules may not be
#: importable by the server.
FORKSERVER_PRELOAD = ["centralpipe.dispatch.worker"]
#: ``current_run`` value that makes every worker skip whatever is queued.
ABANDON_ALL = 2**62


def warm_up(start_method: str, preload: Sequence[str] = FORKSERVER_PRELOAD) -> None:
    """Start the forkserver now (a no-op for other start methods or when it
    runs already), so that it imports ``preload`` (what the workers need, see
    dispatch.preload) while the caller does other work and the first worker
    forks from a ready server.

    Starting it only spawns the server process (milliseconds); the server
    then imports ``preload`` in the background. Workers still fork from a
    clean single-threaded server: forkserver's safety is kept."""
    if start_method != "forkserver":
        return
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(list(preload))
    try:
        forkserver.ensure_running()
    except Exception:  # pragma: no cover - the first worker start reports it
        pass


def describe_exit(exitcode: int | None) -> str:
    """``"exit code 3"`` / ``"killed by SIGKILL"`` / ``"still running"``."""
    import signal

    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class Slot:
    """One worker position: its current worker, channel, and status."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: Any = None  # a Process, or a Thread
        self.conn: Connection | None = None  # processes
        self.inbox: queue.Queue[Encoded | None] | None = None  # threads
        self.status: Any = None
        self.gen = 0  # bumped at each replacement; chunks remember where they went
        self.send_lock = threading.Lock()
        # Write end of the worker's death pipe (see dispatch.worker): held
        # here alone, closed when the worker is replaced or the pool closes.
        self.death: Connection | None = None
        #: A send to this worker is in progress: its results are read even
        #: while paused (dispatch.budget), so the send cannot block forever.
        self.sending = False
        # The worker's shared-memory ring for results (dispatch.shm), one per
        # worker generation; None without one.
        self.ring: shm.Ring | None = None
        #: A send to this worker was cut short (Ctrl-C) and it was killed
        #: for it: its replacement is no fault of the item it was on.
        self.cut_short = False

    def ready(self) -> bool:
        """The worker got as far as its receive loop."""
        return self.status is not None and bool(self.status[STATUS_READY])

    def busy(self) -> tuple[int, int, int, float] | None:
        """``(stream, seq, stage index, started)`` of the item in progress."""
        return None if self.status is None else read_status(self.status)


class Event(NamedTuple):
    """A message from a slot's worker, or (``message is None``) its death;
    ``nbytes``: what the message holds in this process (``dispatch.budget``)."""

    slot: Slot
    message: Any
    nbytes: int = 0


class Executor(abc.ABC):
    """``num_workers`` workers running :func:`~centralpipe.dispatch.worker.serve`."""

    kind = ""
    #: Whether a hung worker can be killed and replaced.
    can_kill = True

    def __init__(self, num_workers: int, spec: WorkerSpec) -> None:
        self.spec = spec
        self.slots = [Slot(i) for i in range(num_workers)]
        self.closed = False
        self.shut = False
        #: Measure the bytes of results (set by the run when it bounds them).
        self.measure = False

    def start(self, stop: Callable[[], bool] | None = None) -> None:
        """Start every worker; ``stop``: checked before each, ends the start
        early (a background start cancelled, see dispatch.starter)."""
        for slot in self.slots:
            if stop is not None and stop():
                return
            self._start(slot)

    def lendable_bytes(self) -> int | None:
        """Bytes of results the workers' rings can lend at once (``None``: no rings)."""
        return None

    def ensure_alive(self) -> None:
        """Replace workers that died (or were given up) between runs."""
        for slot in self.slots:
            if slot.process is None or not slot.process.is_alive():
                self.replace(slot)

    @abc.abstractmethod
    def _start(self, slot: Slot) -> None: ...

    @abc.abstractmethod
    def set_run(self, run_id: int) -> None:
        """Workers skip chunks of runs before ``run_id``."""

    @abc.abstractmethod
    def send(self, slot: Slot, message: Encoded) -> bool:
        """Hand a chunk to the slot's worker (may block while its input is
        full); ``False`` when the worker is gone. Call with ``slot.send_lock``."""

    @abc.abstractmethod
    def send_control(self, slot: Slot, obj: Any) -> bool:
        """A control message (e.g. a state request); ``False`` if gone."""

    @abc.abstractmethod
    def wait(self, timeout: float, paused: frozenset[int] = frozenset()) -> list[Event]:
        """Messages and deaths, waiting at most ``timeout`` seconds; results
        of the ``paused`` slots are left with their workers for now (deaths
        are still reported)."""

    @abc.abstractmethod
    def interrupt(self) -> None:
        """Make a ``wait`` in progress return now (e.g. to stop)."""

    @abc.abstractmethod
    def replace(self, slot: Slot) -> None:
        """A fresh worker in ``slot`` (the old one killed if needed)."""

    @abc.abstractmethod
    def kill(self, slot: Slot) -> None:
        """Stop the slot's worker now, without waiting (processes only)."""

    @abc.abstractmethod
    def exit_text(self, slot: Slot) -> str:
        """How the slot's (dead) worker ended."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop every worker within bounded time; idempotent. A close cut
        short (Ctrl-C) is finished by the next call: ``closed`` is set first
        (senders give up), ``shut`` once everything is released."""


class ProcessPool(Executor):
    """Worker processes started with ``start_method``."""

    kind = "process"

    def __init__(
        self,
        num_workers: int,
        spec: WorkerSpec,
        start_method: str,
        ring_bytes: int = 0,
        preload: Sequence[str] = FORKSERVER_PRELOAD,
    ) -> None:
        super().__init__(num_workers, spec)
        self.ctx: Any = mp.get_context(start_method)
        self.start_method = start_method
        # Each worker's shared-memory ring (0: none; see dispatch.shm), whole pages.
        page = mmap.PAGESIZE
        self.ring_bytes = -(-ring_bytes // page) * page if shm.available() else 0
        self._closed_ring_bytes = [0, 0, 0]  # counters of rings already closed
        self.current_run = self.ctx.RawValue("q", 0)
        # A pipe to ourselves: interrupt() makes wait() return at once.
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._paused: frozenset[int] = frozenset()
        #: Every pipe end and ring opened for a worker and maybe not yet
        #: closed: a close cut short (Ctrl-C) anywhere is finished by close().
        self._ends: list[Connection] = []
        self._rings: list[shm.Ring] = []
        if start_method == "forkserver":
            warm_up(start_method, preload)

    def _parent_fds(self) -> list[int]:
        conns = [c for s in self.slots for c in (s.conn, s.death)]
        fds = [c.fileno() for c in conns if c is not None and not c.closed]
        fds += [fd for s in self.slots if s.ring is not None for fd in s.ring.fds()]
        if not self._wake_r.closed:
            fds += [self._wake_r.fileno(), self._wake_w.fileno()]
        return fds

    def _start(self, slot: Slot) -> None:
        parent, child = self.ctx.Pipe(duplex=True)
        death_r, death_w = self.ctx.Pipe(duplex=False)
        # Registered at once: an interrupt (Ctrl-C) between any two lines
        # below leaves no end open past close(). Closed ends are dropped, so
        # the list does not grow with restarts.
        self._ends = [c for c in self._ends if not c.closed]
        self._ends += [parent, child, death_r, death_w]
        ring = None
        proc = None
        try:
            for conn in (parent, child):
                _grow_socket_buffers(conn)
            if self.ring_bytes:
                self._rings = [r for r in self._rings if not r.released_all()]
                ring = shm.Ring(self.ring_bytes)
                self._rings.append(ring)
            slot.status = self.ctx.RawArray("d", STATUS_LEN)
            close_fds = (
                [*self._parent_fds(), parent.fileno(), death_w.fileno()]
                + (ring.fds() if ring is not None else [])
                if self.start_method == "fork"
                else []
            )
            args = (
                slot.index,
                child,
                self.spec,
                slot.status,
                self.current_run,
                close_fds,
                death_r,
                ring is not None,
            )
            proc = self.ctx.Process(
                target=worker_main, args=args, name=f"centralpipe-worker-{slot.index}", daemon=True
            )
            proc.start()
            # The ring is the first thing on the pipe; a worker already gone
            # is noticed by its sentinel and replaced like any dead worker.
            if ring is not None:
                ring.hand_over(parent)
            # Registered before the finally: cut short there, it is ours to close.
            slot.process, slot.conn, slot.death, slot.ring = proc, parent, death_w, ring
        except BaseException:
            parent.close()  # a failed start leaks no end of either pipe
            death_w.close()
            if ring is not None:
                ring.close()
            if proc is not None and proc.pid is not None:
                _reap(proc)  # started, then cut short: it got EOF; no zombie, no sentinel fd
            raise
        finally:
            child.close()
            death_r.close()

    def set_run(self, run_id: int) -> None:
        self.current_run.value = run_id

    def lendable_bytes(self) -> int | None:
        if not self.ring_bytes:
            return None
        return int(self.ring_bytes * shm.LEND_SHARE) * len(self.slots)

    def transport_bytes(self) -> dict[str, int]:
        """Out-of-band result bytes received through the workers' shared-memory
        rings (of which lent: delivered without a copy) and through their
        pipes, since the pool started."""
        ring, lent, pipe = self._closed_ring_bytes
        for slot in self.slots:
            if slot.ring is not None:
                ring += slot.ring.ring_bytes
                lent += slot.ring.lent_bytes
                pipe += slot.ring.pipe_bytes
        return {"shared_memory_bytes": ring, "shared_memory_lent_bytes": lent, "pipe_bytes": pipe}

    def _close_ring(self, slot: Slot) -> None:
        """Close the slot's ring once its worker is reaped: no later write of
        that worker can reach the ring of the next one. Forgotten only once
        closed: a close cut short is finished by the next call."""
        ring = slot.ring
        if ring is not None:
            ring.close()
            slot.ring = None
            self._closed_ring_bytes[0] += ring.ring_bytes
            self._closed_ring_bytes[1] += ring.lent_bytes
            self._closed_ring_bytes[2] += ring.pipe_bytes

    def send(self, slot: Slot, message: Encoded) -> bool:
        if slot.conn is None:
            return False
        slot.sending = True
        if self._paused:
            self.interrupt()  # the supervisor reads this worker while we write
        try:
            protocol.send_encoded(slot.conn, message)
            return True
        except (OSError, EOFError, ValueError):
            return False  # the worker died; the supervisor replaces it
        except BaseException:
            # Cut short (Ctrl-C in a thread that sends): part of the message
            # may be in the pipe, and the worker could not read the next one
            # in step. It is killed and replaced (its chunks are sent again),
            # with no strike against the item it was on.
            slot.cut_short = True
            self.kill(slot)
            raise
        finally:
            slot.sending = False

    def send_control(self, slot: Slot, obj: Any) -> bool:
        return self.send(slot, protocol.encode(obj))

    def wait(self, timeout: float, paused: frozenset[int] = frozenset()) -> list[Event]:
        self._paused = paused
        waitables: dict[Any, Slot] = {}
        for slot in self.slots:
            if slot.ring is not None:
                slot.ring.flush()
            if slot.conn is not None and slot.index not in paused:
                waitables[slot.conn] = slot
            if slot.process is not None:
                waitables[slot.process.sentinel] = slot
        events: list[Event] = []
        dead: set[int] = set()
        wake = self._wake_r
        for obj in wait([*waitables, wake], timeout):
            if obj is wake:
                while wake.poll():
                    wake.recv_bytes()
                continue
            slot = waitables[obj]
            if slot.index in dead:
                continue
            if isinstance(obj, Connection):
                try:
                    events.append(Event(slot, *protocol.recv_counted(obj, slot.ring)))
                    continue
                except (EOFError, OSError):
                    pass
            dead.add(slot.index)
            events.append(Event(slot, None))
        return events

    def interrupt(self) -> None:
        if not self.closed:
            try:
                self._wake_w.send_bytes(b"")
            except OSError:  # closed meanwhile by close()
                pass

    def replace(self, slot: Slot) -> None:
        """Kill (if needed) and reap the slot's process, close its pipe and
        start a new one. The caller holds ``slot.send_lock``, so no sender is
        writing to the old pipe while it is closed."""
        # Forgotten only once reaped: a replacement cut short (Ctrl-C, when
        # ensure_alive() runs in the consumer) is finished by the next call.
        _reap(slot.process)
        slot.process = None
        _close_death(slot)
        self._close_ring(slot)
        if slot.conn is not None:
            slot.conn.close()  # at once: one fd per restart must not pile up
            slot.conn = None
        slot.gen += 1
        slot.cut_short = False
        self._start(slot)

    def kill(self, slot: Slot) -> None:
        proc = slot.process
        try:
            if proc is not None and proc.is_alive():
                proc.kill()
        except (ProcessLookupError, ValueError):
            pass

    def exit_text(self, slot: Slot) -> str:
        proc = slot.process
        if proc is None:
            return "died"
        proc.join(5.0)
        return f"died ({describe_exit(proc.exitcode)})"

    def exitcode(self, slot: Slot) -> int | None:
        proc = slot.process
        try:
            return None if proc is None else proc.exitcode
        except ValueError:  # pragma: no cover - closed process object
            return None

    def close(self) -> None:
        if self.shut:
            return
        self.closed = True
        self.current_run.value = ABANDON_ALL
        # No stop message: a blocking send could wait forever on a worker that
        # is itself blocked writing a result nobody reads. Closing our ends is
        # the signal: a worker reading gets EOF, one writing gets EPIPE, and
        # one busy in user code is terminated after the join timeout.
        for slot in self.slots:
            if slot.conn is not None:
                slot.conn.close()
                slot.conn = None
        for slot in self.slots:
            if slot.process is not None:
                _reap(slot.process, graceful=True)
                slot.process = None
            _close_death(slot)
            self._close_ring(slot)
        for end in self._ends:
            end.close()
        for ring in self._rings:
            ring.close()
        self._wake_r.close()
        self._wake_w.close()
        self.shut = True


class ThreadPool(Executor):
    """Worker threads in this process: for functions that release the GIL
    (tokenizers in Rust or C++, torch ops, decoders) and free-threaded
    Python. Items are copied on the way in, as a process would receive them;
    outputs are handed over as they are."""

    kind = "thread"
    can_kill = False

    def __init__(self, num_workers: int, spec: WorkerSpec) -> None:
        super().__init__(num_workers, spec)
        self.current_run = types.SimpleNamespace(value=0)
        self.outbox: queue.Queue[tuple[int, int, Any] | None] = queue.Queue()
        # Paused slots (dispatch.budget): their threads wait before handing
        # over a result, re-checking every _PAUSE_POLL_S.
        self._paused: frozenset[int] = frozenset()
        self._resume = threading.Condition()

    def _start(self, slot: Slot) -> None:
        inbox: queue.Queue[Encoded | None] = queue.Queue()
        slot.inbox = inbox
        slot.status = [0.0] * STATUS_LEN
        gen, index, outbox = slot.gen, slot.index, self.outbox

        def recv() -> Any:
            message = inbox.get()
            if message is None:
                raise EOFError
            return protocol.decode(message)

        def send_result(run_id: int, stream: int, cid: int, result: Any, per: bool) -> bool:
            # Not serialised: outputs are grouped per input where the
            # supervisor expects them so (a chunk re-sent item by item).
            if per and not isinstance(result.outputs, protocol.Undecodable):
                result = protocol.group_outputs(result)
            with self._resume:
                while index in self._paused and slot.gen == gen and not self.closed:
                    self._resume.wait(_PAUSE_POLL_S)
            outbox.put((index, gen, (MSG_RESULT, run_id, stream, cid, result)))
            return True

        def send_states(states: Any) -> bool:
            outbox.put((index, gen, (MSG_STATES, states)))
            return True

        def run() -> None:
            try:
                serve(recv, send_result, send_states, self.spec, slot.status, self.current_run)
            finally:
                outbox.put((index, gen, None))

        thread = threading.Thread(target=run, name=f"centralpipe-worker-{index}", daemon=True)
        thread.start()
        slot.process = thread

    def set_run(self, run_id: int) -> None:
        self.current_run.value = run_id

    def send(self, slot: Slot, message: Encoded) -> bool:
        if slot.inbox is None or self.closed:
            return False
        slot.inbox.put(message)
        if slot.index in self._paused:
            self.interrupt()  # the supervisor decides again whether to hold it back
        return True

    def send_control(self, slot: Slot, obj: Any) -> bool:
        return self.send(slot, protocol.encode(obj))

    def wait(self, timeout: float, paused: frozenset[int] = frozenset()) -> list[Event]:
        if paused != self._paused:
            with self._resume:
                self._paused = paused
                self._resume.notify_all()
        events: list[Event] = []
        try:
            got = [self.outbox.get(timeout=timeout)]
        except queue.Empty:
            return events
        while True:
            try:
                got.append(self.outbox.get_nowait())
            except queue.Empty:
                break
        for entry in got:
            if entry is None:  # interrupt()
                continue
            index, gen, msg = entry
            slot = self.slots[index]
            if gen == slot.gen:  # else: from a worker given up on
                nbytes = 0
                if self.measure and msg is not None and msg[0] == MSG_RESULT:
                    nbytes = estimate_nbytes(msg[4].outputs)
                events.append(Event(slot, msg, nbytes))
        return events

    def interrupt(self) -> None:
        self.outbox.put(None)

    def replace(self, slot: Slot) -> None:
        """A fresh thread in ``slot``; an old one still running (stuck in user
        code: threads cannot be killed) is given up and its results ignored."""
        if slot.inbox is not None:
            slot.inbox.put(None)
        slot.gen += 1
        self._start(slot)

    def kill(self, slot: Slot) -> None:
        """Threads cannot be killed; see :meth:`replace`."""

    def exit_text(self, slot: Slot) -> str:
        return "stopped (its thread ended)"

    def close(self) -> None:
        if self.shut:
            return
        self.closed = True
        self.current_run.value = ABANDON_ALL
        with self._resume:
            self._resume.notify_all()
        for slot in self.slots:
            if slot.inbox is not None:
                slot.inbox.put(None)
        for slot in self.slots:
            if slot.process is not None:
                slot.process.join(_THREAD_JOIN_TIMEOUT_S)
                slot.process = None
        self.shut = True


def _close_death(slot: Slot) -> None:
    """Close the slot's death pipe, once its worker is reaped (closing it
    first would end the worker with SIGIO)."""
    if slot.death is not None:
        slot.death.close()
        slot.death = None


def _grow_socket_buffers(conn: Connection) -> None:
    """Ask for socket buffers that hold a few large tensors: a 256 KiB message
    through the default ~208 KiB buffer needs several wake-ups of both sides.
    The kernel caps the size at net.core.wmem_max/rmem_max; failure is harmless."""
    import socket

    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    except OSError:
        pass
    finally:
        sock.close()


def _reap(proc: Any, graceful: bool = False) -> int | None:
    """Make sure ``proc`` has exited: join, then terminate, then kill."""
    if proc is None:
        return None
    try:
        if proc.pid is None:  # never started, or its close() was cut short
            return None
    except ValueError:  # closed: reaped already (by a close cut short)
        return None
    if graceful:
        proc.join(_JOIN_TIMEOUT_S)
    if proc.is_alive():
        proc.terminate()
        proc.join(_TERMINATE_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join(_KILL_TIMEOUT_S)
    else:
        proc.join(0)
    code: int | None = proc.exitcode
    try:
        proc.close()
    except ValueError:  # pragma: no cover - still running after kill
        pass
    return code
