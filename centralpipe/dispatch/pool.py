"""The worker processes: start, replace, and shut down.

Each slot has one process and one duplex pipe. A shared status array per slot
says which ``seq`` (and stage) the worker is on and since when, so the main
process can time out a hung item and name the item that killed a worker
without asking the worker anything. Shutdown escalates stop message → join →
terminate → kill, each with a bounded timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from multiprocessing.connection import Connection
from typing import Any

from centralpipe.dispatch.protocol import (
    STATUS_LEN,
    STATUS_READY,
    STATUS_SEQ,
    STATUS_STAGE,
    STATUS_STARTED,
)
from centralpipe.dispatch.worker import WorkerSpec, worker_main

__all__ = ["Slot", "WorkerPool", "describe_exit"]

_JOIN_TIMEOUT_S = 2.0
_TERMINATE_TIMEOUT_S = 1.0
_KILL_TIMEOUT_S = 5.0
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024


#: What the forkserver imports once, before it forks any worker: the worker
#: loop and what it needs (torch, numpy). The user's stage functions are
#: imported by each worker; their modules may not be importable by the server.
FORKSERVER_PRELOAD = ["centralpipe.dispatch.worker"]


def warm_up(start_method: str) -> None:
    """Start the forkserver now (a no-op for other start methods or when it
    runs already), so that it imports torch while the caller does other work
    (building a model) and the first worker forks from a ready server.

    Starting it only spawns the server process (milliseconds); the server
    then imports :data:`FORKSERVER_PRELOAD` in the background. Workers still
    fork from a clean single-threaded server: forkserver's safety is kept."""
    if start_method != "forkserver":
        return
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
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
    """One worker position: its current process, pipe, and status."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: Any = None
        self.conn: Connection | None = None
        self.status: Any = None
        self.gen = 0  # bumped at each replacement; chunks remember where they went
        self.send_lock = threading.Lock()
        self.retired: list[Connection] = []
        # Write end of the worker's death pipe (see dispatch.worker): held
        # here alone, closed when the worker is replaced or the pool closes.
        self.death: Connection | None = None
        self.items = 0

    def ready(self) -> bool:
        """The worker got as far as its receive loop."""
        return bool(self.status[STATUS_READY])

    def busy_seq(self) -> tuple[int | None, int | None, float]:
        """(seq, stage index, started monotonic time) of the item in progress."""
        started = self.status[STATUS_STARTED]
        if not started:
            return None, None, 0.0
        return int(self.status[STATUS_SEQ]), int(self.status[STATUS_STAGE]), started


class WorkerPool:
    """``num_workers`` worker processes, started with ``start_method``."""

    def __init__(self, num_workers: int, start_method: str, spec: WorkerSpec) -> None:
        self.ctx: Any = mp.get_context(start_method)
        self.start_method = start_method
        self.spec = spec
        self.slots = [Slot(i) for i in range(num_workers)]
        self.current_run = self.ctx.RawValue("q", 0)
        self.closed = False
        if start_method == "forkserver":
            warm_up(start_method)

    def start(self) -> None:
        for slot in self.slots:
            self._start(slot)

    def _parent_fds(self) -> list[int]:
        fds = []
        for slot in self.slots:
            for conn in (slot.conn, slot.death, *slot.retired):
                if conn is not None and not conn.closed:
                    fds.append(conn.fileno())
        return fds

    def _start(self, slot: Slot) -> None:
        parent, child = self.ctx.Pipe(duplex=True)
        for conn in (parent, child):
            _grow_socket_buffers(conn)
        slot.status = self.ctx.RawArray("d", STATUS_LEN)
        death_r, death_w = self.ctx.Pipe(duplex=False)
        close_fds = (
            [*self._parent_fds(), parent.fileno(), death_w.fileno()]
            if self.start_method == "fork"
            else []
        )
        args = (slot.index, child, self.spec, slot.status, self.current_run, close_fds, death_r)
        proc = self.ctx.Process(
            target=worker_main,
            args=args,
            name=f"centralpipe-worker-{slot.index}",
            daemon=True,
        )
        try:
            proc.start()
        except BaseException:
            death_w.close()
            raise
        finally:
            child.close()
            death_r.close()
        slot.process = proc
        slot.conn = parent
        slot.death = death_w

    def replace(self, slot: Slot) -> int | None:
        """Kill (if needed) and reap the slot's process, start a new one;
        returns the old exit code. The old pipe is kept open in ``retired``
        until :meth:`close_retired`, so a sender thread still holding it can
        never write into a reused file descriptor."""
        old = slot.process
        exitcode = _reap(old)
        _close_death(slot)
        if slot.conn is not None:
            slot.retired.append(slot.conn)
        slot.conn = None
        self._start(slot)
        slot.gen += 1
        return exitcode

    def close_retired(self) -> None:
        for slot in self.slots:
            for conn in slot.retired:
                conn.close()
            slot.retired.clear()

    def ensure_alive(self) -> None:
        """Replace workers that died between runs."""
        for slot in self.slots:
            if slot.process is None or not slot.process.is_alive():
                self.replace(slot)

    def set_run(self, run_id: int) -> None:
        self.current_run.value = run_id

    def close(self) -> None:
        """Stop every worker within bounded time; idempotent."""
        if self.closed:
            return
        self.closed = True
        self.current_run.value = 2**62  # workers skip whatever is still queued
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
        self.close_retired()


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


def kill_now(proc: Any) -> None:
    """SIGKILL a worker (hung item) without waiting."""
    try:
        if proc is not None and proc.is_alive():
            proc.kill()
    except (ProcessLookupError, ValueError):
        pass
