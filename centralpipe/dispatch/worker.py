"""The worker loop: receive chunks, run the worker stages, send results.

Workers are stateless: a chunk's result depends only on its items, the seed,
the epoch and the items' ``seq``. A worker exits when its pipe closes (the
main process closed it, or died), or — should it be busy in user code — when
a watchdog thread sees the main process gone.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from centralpipe.dispatch import protocol
from centralpipe.dispatch.chain import WorkerChain
from centralpipe.dispatch.protocol import (
    MSG_CHUNK,
    MSG_RESULT,
    MSG_STATES,
    STATUS_READY,
    ChunkResult,
    StageFailure,
)

__all__ = ["WorkerSpec", "worker_main"]
#: How often a worker checks that the main process is still alive.
_WATCHDOG_INTERVAL_S = 1.0


class WorkerSpec:
    """Everything a worker needs, sent once when it starts."""

    def __init__(self, chain: WorkerChain, main_pid: int, torch_threads: int = 1) -> None:
        self.chain = chain
        self.main_pid = main_pid
        self.torch_threads = torch_threads


def _watchdog(main_pid: int) -> None:
    while True:
        time.sleep(_WATCHDOG_INTERVAL_S)
        try:
            os.kill(main_pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:  # pragma: no cover - pid reused by another user
            os._exit(0)


def worker_main(
    slot: int,
    conn: Connection,
    spec: WorkerSpec,
    status: Any,
    current_run: Any,
    close_fds: list[int],
) -> None:
    """Entry point of a worker process (``multiprocessing.Process`` target)."""
    # Ctrl-C goes to the whole process group; the main process decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for fd in close_fds:  # the parent's ends of other pipes, inherited by fork
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        import torch

        torch.set_num_threads(spec.torch_threads)
    except Exception:  # pragma: no cover - torch missing threads support
        pass
    threading.Thread(target=_watchdog, args=(spec.main_pid,), daemon=True).start()
    chain = spec.chain
    status[STATUS_READY] = 1.0
    while True:
        try:
            msg = protocol.recv(conn)
        except (EOFError, OSError):
            break
        kind = msg[0]
        if kind == MSG_CHUNK:
            _, run_id, cid, epoch, first_seq, items, skip = msg
            if run_id < current_run.value:
                continue  # the main process abandoned that run
            result = chain.run_chunk(epoch, first_seq, items, skip, status)
            if not _send_result(conn, (MSG_RESULT, run_id, cid, result), chain):
                break
        elif kind == MSG_STATES:
            try:
                protocol.send(conn, (MSG_STATES, chain.states()))
            except (OSError, EOFError):
                break
    conn.close()
    sys.exit(0)


def _send_result(conn: Connection, msg: tuple[Any, ...], chain: WorkerChain) -> bool:
    """Send a result; outputs that cannot be pickled become failures of the
    last worker stage. False when the main process is gone."""
    try:
        protocol.send(conn, msg)
        return True
    except (OSError, EOFError):
        return False
    except Exception:
        pass
    kind, run_id, cid, result = msg
    result = _drop_unpicklable(result, chain)
    try:
        protocol.send(conn, (kind, run_id, cid, result))
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
