"""The worker loop: receive chunks, run the worker stages, send results.

Workers are stateless: a chunk's result depends only on its items, the seed,
the epoch and the items' ``seq``. The same loop (:func:`serve`) runs in a
worker process (:func:`worker_main`, over a pipe) and in a worker thread
(over queues, see :mod:`centralpipe.dispatch.executors.threadpool`). A worker process exits
when its pipe closes (the main process closed it, or died). Should it be busy in user code when the
main process dies, two more guards end it within about a second:

- the *death pipe*: the main process holds the only write end of a pipe whose
  read end the worker arms for ``SIGIO`` (``O_ASYNC``). When the main process
  exits, however it dies, the kernel closes that end and sends the worker
  ``SIGIO``, whose default action ends the process, even inside a C call
  that holds the GIL and whatever process (the forkserver) is its parent;
- a watchdog thread sees the parent gone (re-parented, as happens at once
  when the parent exits, even while it is an unreaped zombie) or the main
  process missing or a zombie: the guard where ``O_ASYNC`` is not available.
"""

from __future__ import annotations

import fcntl
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from centralpipe.dispatch import priority, timeouts
from centralpipe.dispatch.wire import protocol
from centralpipe.dispatch.wire.protocol import (
    MSG_CHUNK,
    MSG_RESULT,
    MSG_STATES,
    STATUS_READY,
    ChunkResult,
    StageFailure,
)
from centralpipe.dispatch.wire.ringwriter import RingWriter, receive_ring, stash
from centralpipe.dispatch.worker.chain import WorkerChain
from centralpipe.dispatch.worker.ranges import LineRange, run_range

__all__ = ["WorkerSpec", "result_message", "run_received", "serve", "worker_main"]

#: ``send_result(run_id, stream, cid, result, per_item) -> still connected``
SendResult = Callable[[int, int, int, ChunkResult, bool], bool]


class WorkerSpec:
    """Everything a worker needs, sent once when it starts: one chain of
    worker stages per ordered stream (indexed by stream id)."""

    def __init__(
        self, chains: Sequence[WorkerChain], main_pid: int, torch_threads: int = 1
    ) -> None:
        self.chains = list(chains)
        self.main_pid = main_pid
        self.torch_threads = torch_threads

    def states(self) -> dict[str, Any]:
        """Stateful worker-stage states of every chain, by stage name."""
        out: dict[str, Any] = {}
        for chain in self.chains:
            out.update(chain.states())
        return out


def serve(
    recv: Callable[[], Any],
    send_result: SendResult,
    send_states: Callable[[dict[str, Any]], bool],
    spec: WorkerSpec,
    status: Any,
    current_run: Any,
) -> None:
    """Run chunks until ``recv`` raises ``EOFError``/``OSError`` or a send
    returns ``False`` (the main side is gone)."""
    status[STATUS_READY] = 1.0
    while True:
        try:
            msg = recv()
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == MSG_CHUNK:
            _, run_id, stream, cid, epoch, first_seq, items, skip, per_item, key = msg
            if run_id < current_run.value:
                continue  # the main process abandoned that run
            chain = spec.chains[stream]
            result = run_received(
                chain, stream, epoch, first_seq, items, skip, per_item, status, key
            )
            if not send_result(run_id, stream, cid, result, per_item):
                return
        elif kind == MSG_STATES and not send_states(spec.states()):
            return


def main_alive(main_pid: int) -> bool:
    """False when ``main_pid`` is gone or a zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{main_pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel (a zombie still counts as alive)
        try:
            os.kill(main_pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    state = stat.rpartition(b")")[2].split()[:1]
    return state not in ([b"Z"], [b"X"])


def arm_death_pipe(death: Connection) -> bool:
    """Have the kernel end this process (``SIGIO``) when the write end of
    ``death``, held by the main process alone, closes. False when it already
    has (the main process died before we got here)."""
    fd = death.fileno()
    try:
        signal.signal(signal.SIGIO, signal.SIG_DFL)
        fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK | getattr(os, "O_ASYNC", 0))
    except (AttributeError, OSError, ValueError):  # pragma: no cover - no O_ASYNC here
        return True  # the watchdog thread remains
    try:
        return os.read(fd, 1) != b""  # b"": closed before O_ASYNC was set
    except BlockingIOError:
        return True


def _watchdog(main_pid: int, parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid or not main_alive(main_pid):
            os._exit(0)
        time.sleep(timeouts.WORKER_WATCHDOG_S)


def worker_main(
    slot: int,
    conn: Connection,
    spec: WorkerSpec,
    status: Any,
    current_run: Any,
    close_fds: list[int],
    death: Connection | None = None,
    with_ring: bool = False,
) -> None:
    """Entry point of a worker process (``multiprocessing.Process`` target)."""
    # Ctrl-C goes to the whole process group; the main process decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent_pid = os.getppid()
    priority.match(spec.main_pid)  # a service's workers are as nice as it is
    if (death is not None and not arm_death_pipe(death)) or not main_alive(spec.main_pid):
        os._exit(0)
    for fd in close_fds:  # the parent's ends of other pipes, inherited by fork
        try:
            os.close(fd)
        except OSError:
            pass
    threads = TorchThreads(spec.torch_threads)
    threading.Thread(target=_watchdog, args=(spec.main_pid, parent_pid), daemon=True).start()
    ring = None
    if with_ring:  # the first thing on the pipe (see dispatch.shm)
        try:
            ring = receive_ring(conn)
        except (EOFError, OSError):
            os._exit(0)
        for chain in spec.chains:  # large outputs go into the ring as they are made
            chain.keep = functools.partial(stash, ring=ring)

    def send_result(run_id: int, stream: int, cid: int, result: ChunkResult, per: bool) -> bool:
        try:
            return _send_result(conn, run_id, stream, cid, result, per, spec.chains[stream], ring)
        finally:
            if ring is not None:
                ring.forget()  # space of outputs that were not sent

    def send_states(states: dict[str, Any]) -> bool:
        try:
            protocol.send(conn, (MSG_STATES, states), ring)
            return True
        except (OSError, EOFError):
            return False

    def recv() -> Any:
        message = protocol.recv(conn)
        threads.limit()  # torch may have come with the message or the last chunk
        return message

    serve(recv, send_result, send_states, spec, protocol.writable_status(status), current_run)
    conn.close()
    sys.exit(0)


class TorchThreads:
    """Limits torch's intra-op threads in a worker to ``n`` once torch is
    imported. A worker imports torch only if its functions or items need it
    (the server preloads it only then, see :mod:`centralpipe.dispatch.executors.preload`),
    so the limit is applied when torch first shows up: at start, or after the
    message or chunk that imported it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.done = False
        self.limit()

    def limit(self) -> None:
        if self.done:
            return
        torch = sys.modules.get("torch")
        if torch is None:
            return
        self.done = True
        try:
            torch.set_num_threads(self.n)
        except Exception:  # pragma: no cover - a torch without threads support
            pass


def run_received(
    chain: WorkerChain,
    stream: int,
    epoch: int,
    first_seq: int,
    items: Any,
    skip: frozenset[int],
    per_item: bool,
    status: Any,
    rng_key: tuple[int, int],
) -> ChunkResult:
    """Run a chunk whose items arrived sealed (see ``protocol``)."""
    if not per_item:
        if isinstance(items, protocol.Undecodable):
            # Some item cannot be unpickled here: the main process re-sends
            # the chunk per item to find out which.
            return ChunkResult(items, None, None, 0.0)  # type: ignore[arg-type]
        if isinstance(items, LineRange):  # the lines of a byte range: read them here
            return run_range(chain, items, epoch, first_seq, skip, status, stream, rng_key)
        return chain.run_chunk(epoch, first_seq, items, skip, status, stream, rng_key)
    bad = []
    for i, item in enumerate(items):
        if isinstance(item, protocol.Undecodable):
            text = f"the item cannot be unpickled in the worker: {item.message}"
            bad.append(StageFailure(i, None, item.exc_type, text, ""))
    if bad:
        skip = frozenset(skip).union(f.at for f in bad)
        items = [None if i in skip else x for i, x in enumerate(items)]
    result = chain.run_chunk(epoch, first_seq, items, skip, status, stream, rng_key)
    if bad:
        counts = result.counts or [1] * len(items)
        failures = sorted([*(result.failures or ()), *bad], key=lambda f: f.at)
        result = result._replace(counts=counts, failures=failures)
    return result


def result_message(
    run_id: int, stream: int, cid: int, result: ChunkResult, per_item: bool, chain: WorkerChain
) -> protocol.Encoded:
    """The ``MSG_RESULT`` :func:`_send_result` sends (without a ring),
    encoded: outputs that cannot be pickled become failures of the last
    worker stage."""
    try:
        if isinstance(result.outputs, protocol.Undecodable):
            return protocol.encode((MSG_RESULT, run_id, stream, cid, result))
        sealed = protocol.seal_outputs(result, per_item, chain.flat_arrays)
        return protocol.encode((MSG_RESULT, run_id, stream, cid, sealed))
    except Exception:
        pass
    sealed = protocol.seal_outputs(_drop_unpicklable(result, chain), per_item, chain.flat_arrays)
    return protocol.encode((MSG_RESULT, run_id, stream, cid, sealed))


def _send_result(
    conn: Connection,
    run_id: int,
    stream: int,
    cid: int,
    result: ChunkResult,
    per_item: bool,
    chain: WorkerChain,
    ring: RingWriter | None = None,
) -> bool:
    """Send a result; outputs that cannot be pickled become failures of the
    last worker stage. False when the main process is gone."""
    try:
        if isinstance(result.outputs, protocol.Undecodable):
            protocol.send(conn, (MSG_RESULT, run_id, stream, cid, result), ring)
        else:
            protocol.send_result(
                conn, run_id, stream, cid, result, per_item, ring, chain.flat_arrays
            )
        return True
    except (OSError, EOFError):
        return False
    except Exception:
        pass
    result = protocol.seal_outputs(_drop_unpicklable(result, chain), per_item, chain.flat_arrays)
    try:
        protocol.send(conn, (MSG_RESULT, run_id, stream, cid, result), ring)
        return True
    except (OSError, EOFError):
        return False


def _drop_unpicklable(result: ChunkResult, chain: WorkerChain) -> ChunkResult:
    stage = chain.specs[-1].name if chain.specs else "dispatch"
    counts = result.counts or [1] * len(result.outputs)
    failures = list(result.failures or [])
    outputs: list[Any] = []
    new_counts: list[int] = []
    pos = 0
    for i, n in enumerate(counts):
        mine = result.outputs[pos : pos + n]
        pos += n
        exc = protocol.picklable_error(mine)
        if exc is not None:
            message = f"the result cannot be pickled to send it to the main process: {exc}"
            failures.append(StageFailure(i, stage, type(exc).__name__, message, ""))
            new_counts.append(0)
            continue
        outputs.extend(mine)
        new_counts.append(n)
    failures.sort(key=lambda f: f.at)
    return ChunkResult(outputs, new_counts, failures or None, result.elapsed_s)
