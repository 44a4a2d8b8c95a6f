"""Worker processes: the executor that runs worker stages in processes.

Each slot's worker is a process with a duplex pipe, a death pipe (it exits
when the main process goes) and a shared-memory ring for large results
(:mod:`centralpipe.dispatch.wire.ringreader`). Shutdown escalates: close our pipe ends (a
worker reading gets EOF, one writing gets EPIPE) → join → terminate → kill,
each bounded.
"""

import _thread
import mmap
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

from centralpipe.dispatch import timeouts
from centralpipe.dispatch.executors.pool import ABANDON_ALL, Event, Executor, Slot, describe_exit
from centralpipe.dispatch.wire import protocol, ringreader
from centralpipe.dispatch.wire.protocol import (
    STATUS_LEN,
    Encoded,
)
from centralpipe.dispatch.worker.loop import WorkerSpec, worker_main

__all__ = ["FORKSERVER_PRELOAD", "SOCKET_BUFFER_BYTES", "ProcessPool", "warm_up"]

SOCKET_BUFFER_BYTES = 4 * 1024 * 1024
T = TypeVar("T")
#: What the forkserver imports once, before it forks any worker, unless told
#: otherwise: the worker loop (torch-free; see dispatch.preload). The user's
#: stage functions are imported by each worker; their modules may not be
#: importable by the server.
FORKSERVER_PRELOAD = ["centralpipe.dispatch.worker.loop"]


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
        self.ring_bytes = -(-ring_bytes // page) * page if ringreader.available() else 0
        self._closed_ring_bytes = [0, 0, 0]  # counters of rings already closed
        self.current_run = _off_the_main_thread(lambda: self.ctx.RawValue("q", 0))
        # A pipe to ourselves: interrupt() makes wait() return at once.
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._paused: frozenset[int] = frozenset()
        #: Every pipe end and ring opened for a worker and maybe not yet
        #: closed: a close cut short (Ctrl-C) anywhere is finished by close().
        self._ends: list[Connection] = []
        self._rings: list[ringreader.Ring] = []
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
                ring = ringreader.Ring(self.ring_bytes)
                self._rings.append(ring)
            # Off the main thread too: multiprocessing's heap makes a file in
            # /dev/shm and unlinks it in Python code, which a Ctrl-C can cut
            # between the two (the file then stays for good).
            slot.status = _off_the_main_thread(lambda: self.ctx.RawArray("d", STATUS_LEN))
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
            if self.start_method == "fork":
                _off_the_main_thread(proc.start)
            else:
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
        return int(self.ring_bytes * ringreader.LEND_SHARE) * len(self.slots)

    def transport_bytes(self) -> dict[str, int] | None:
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
        try:
            slot.sending = True
            if self._paused:
                self.interrupt()  # the supervisor reads this worker while we write
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

    def wait(
        self, timeout: float, paused: frozenset[int] = frozenset(), reader: object = None
    ) -> list[Event]:
        if reader is not self.reader:
            return []
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
            with self.read_lock:
                # A later run claimed the workers while this one waited: what
                # is ready now is that run's (see ``claim``).
                if reader is not self.reader:
                    return events
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

    def startup_death_text(self) -> str:
        return (
            f" while starting up (start method '{self.start_method}'; with forkserver or "
            'spawn the main script must be guarded by `if __name__ == "__main__":` and '
            "stage functions importable)"
        )

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


def _off_the_main_thread(fn: Callable[[], T]) -> T:
    """``fn()`` run in a helper thread when called from the main thread.

    For the few steps whose cleanup is Python code that a Ctrl-C must not
    cut short. ``os.fork()`` runs Python's at-fork hooks in the forking
    thread (logging takes its module lock before the fork and releases it
    after, in Python code), and an exception raised in a hook is printed and
    dropped: in the main thread a Ctrl-C landing in the hook that releases
    logging's lock leaves the lock held, and the next log call of any thread
    (a worker's death warning) waits forever. Signal handlers run only in
    the main thread, so the helper's steps run to their end. The caller
    waits for them whatever lands meanwhile (they take milliseconds), then
    raises a Ctrl-C that came in the wait, with ``fn``'s effect complete."""
    if threading.current_thread() is not threading.main_thread():
        return fn()
    result: list[T] = []
    failed: list[BaseException] = []
    # Plain lists, not a threading.Event: its Python-level Condition is not
    # safe against a Ctrl-C in wait() ("release unlocked lock").
    finished: list[bool] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:
            failed.append(exc)
        finally:
            finished.append(True)

    interrupted: BaseException | None = None
    try:
        # A C call: a Ctrl-C raised here is handled as it returns, so the
        # thread has started whenever this block is left by one.
        _thread.start_new_thread(run, ())
    except BaseException as exc:
        interrupted = exc
    while not finished:
        try:
            time.sleep(timeouts.FORK_POLL_S)
        except BaseException as exc:  # a Ctrl-C in the wait: fn still finishes
            interrupted = exc
    if failed:
        raise failed[0]
    if interrupted is not None:
        raise interrupted
    return result[0]


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
        proc.join(timeouts.JOIN_TIMEOUT_S)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeouts.TERMINATE_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join(timeouts.KILL_TIMEOUT_S)
    else:
        proc.join(0)
    code: int | None = proc.exitcode
    try:
        proc.close()
    except ValueError:  # pragma: no cover - still running after kill
        pass
    return code
