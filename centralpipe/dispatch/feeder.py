"""How a run gets its chunks' results: inline, or through worker processes.

:class:`InlineRun` (``num_workers=0``) runs the worker stages in the calling
thread. :class:`PoolRun` starts a *feeder* thread that pulls chunks from the
central chain and sends them round-robin to the workers; the consumer thread
receives results from every worker (stashing them by chunk id, so no worker
ever blocks on a full pipe while the consumer waits for another), watches
process sentinels and per-item deadlines, replaces dead or hung workers and has
their unfinished chunks re-sent. Only the feeder thread sends chunks, so a
chunk is never sent twice to the same worker generation.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from multiprocessing.connection import Connection, wait
from typing import Any

from centralpipe.dispatch import transport
from centralpipe.dispatch.pool import Slot, WorkerPool, describe_exit, kill_now
from centralpipe.dispatch.run import Chunk, Run, logger
from centralpipe.dispatch.worker import MSG_CHUNK, MSG_RESULT, MSG_STATES
from centralpipe.errors import WorkerError

__all__ = ["InlineRun", "PoolRun"]

#: Longest single wait for worker results before re-checking liveness.
POLL_S = 0.1
#: How long stopping a run may take before stuck workers are killed.
STOP_TIMEOUT_S = 5.0


class InlineRun(Run):
    """Worker stages run in the consumer's thread, one chunk at a time."""

    def wait_head(self) -> Chunk | None:
        with self.lock:
            if self.pending and self.pending[0].result is not None:
                return self.pending[0]
        chunk = self.pull_chunk()
        if chunk is None:
            return None
        # The worker stages get a copy, as a worker would: a stage that mutates
        # its item in place must not change the checkpoint's in-flight items.
        items = self.copy_items(chunk)
        result = self.chain.run_chunk(self.epoch, chunk.first_seq, items, self.run_skip(chunk))
        chunk.result = self.accept(chunk, result)
        return chunk


class PoolRun(Run):
    """Worker stages run in the pool's processes; see the module docstring."""

    def __init__(
        self,
        *,
        pool: WorkerPool,
        run_id: int,
        timeout_s: float | None,
        max_restarts: int,
        item_retries: int,
        **kw: Any,
    ) -> None:
        super().__init__(parallelism=len(pool.slots), **kw)
        self.pool = pool
        self.run_id = run_id
        self.timeout_s = timeout_s
        self.max_restarts = max_restarts
        self.item_retries = item_retries
        self.resend: deque[Chunk] = deque()
        self.strikes: dict[int, int] = defaultdict(int)
        self.feeder_error: BaseException | None = None
        self._rr = 0
        self.states: dict[int, Any] = {}
        pool.set_run(run_id)
        pool.ensure_alive()
        self.feeder = threading.Thread(target=self._feed, name="centralpipe-feeder", daemon=True)
        self.feeder.start()

    # -- feeder thread ---------------------------------------------------------

    def _feed(self) -> None:
        try:
            while True:
                with self.cond:
                    while (
                        not self.stopping
                        and not self.resend
                        and (
                            self.exhausted
                            or (self.buffer_size is not None and self.in_flight >= self.buffer_size)
                        )
                    ):
                        self.cond.wait(POLL_S)
                    if self.stopping:
                        return
                    resend = list(self.resend)
                    self.resend.clear()
                if resend:
                    for old in resend:
                        self._send(old)
                    continue
                chunk = self.pull_chunk()
                if chunk is not None:
                    chunk.slot = self._rr
                    self._rr = (self._rr + 1) % len(self.pool.slots)
                    self._send(chunk)
        except BaseException as exc:  # pragma: no cover - a bug; reported by the consumer
            self.feeder_error = exc

    def _send(self, chunk: Chunk) -> None:
        slot = self.pool.slots[chunk.slot]
        with slot.send_lock:
            if chunk.sent_gen == slot.gen or chunk.result is not None or slot.conn is None:
                return

            def message(items: list[Any]) -> tuple[Any, ...]:
                skip = self.run_skip(chunk)
                return (MSG_CHUNK, self.run_id, chunk.cid, self.epoch, chunk.first_seq, items, skip)

            try:
                head, buffers = transport.dumps(message(chunk.items))
            except Exception:
                head, buffers = transport.dumps(message(self.sendable_items(chunk)))
            try:
                slot.conn.send_bytes(head)
                for buf in buffers:
                    slot.conn.send_bytes(buf)
                chunk.sent_gen = slot.gen
            except (OSError, EOFError, ValueError):
                pass  # the worker died; the consumer replaces it and re-sends

    # -- consumer side -----------------------------------------------------------

    def wait_head(self) -> Chunk | None:
        started = time.perf_counter()
        try:
            while True:
                with self.lock:
                    if self.pending:
                        head = self.pending[0]
                        if head.closed and head.result is not None:
                            return head
                    elif self.exhausted:
                        return None
                if self.feeder_error is not None:
                    raise RuntimeError("centralpipe feeder thread failed") from self.feeder_error
                self._poll(POLL_S)
        finally:
            self.stats.wait_workers_s += time.perf_counter() - started

    def _poll(self, timeout: float) -> None:
        waitables: dict[Any, Slot] = {}
        for slot in self.pool.slots:
            if slot.conn is not None:
                waitables[slot.conn] = slot
            if slot.process is not None:
                waitables[slot.process.sentinel] = slot
        ready = wait(list(waitables), timeout)
        dead: list[Slot] = []
        for obj in ready:
            slot = waitables[obj]
            if isinstance(obj, Connection):
                if slot.conn is not obj or slot in dead:
                    continue
                try:
                    msg = transport.recv(obj)
                except (EOFError, OSError):
                    dead.append(slot)
                    continue
                except BaseException:
                    # Interrupted mid-message (Ctrl-C): the pipe's framing is
                    # lost, so this worker is replaced before it is read again.
                    self._recover(slot, hung=False, desynced=True)
                    raise
                self._handle(slot, msg)
            elif slot not in dead:
                dead.append(slot)
        for slot in dead:
            self._recover(slot, hung=False)
        if self.timeout_s is not None:
            now = time.monotonic()
            for slot in self.pool.slots:
                seq, _, started = slot.busy_seq()
                if seq is not None and now - started > self.timeout_s:
                    self._recover(slot, hung=True)

    def _handle(self, slot: Slot, msg: Any) -> None:
        if msg[0] == MSG_RESULT:
            _, run_id, cid, result = msg
            if run_id != self.run_id:
                return
            chunk = self.by_cid.get(cid)
            if chunk is None or chunk.result is not None:
                return
            self.stats.items_per_worker[slot.index] += len(chunk.items)
            chunk.result = self.accept(chunk, result)
        elif msg[0] == MSG_STATES:
            self.states[slot.index] = msg[1]

    def _recover(self, slot: Slot, *, hung: bool, desynced: bool = False) -> None:
        """A worker died or hung: replace it and have its chunks re-sent."""
        seq, stage_index, _ = slot.busy_seq()
        if seq is not None and not any(
            c.first_seq <= seq < c.first_seq + len(c.items) for c in self.pending
        ):
            seq = None  # busy with an abandoned run's item: not this run's business
        proc = slot.process
        kill_now(proc)
        if proc is not None:
            proc.join(5.0)
        if desynced:
            self._replace_and_resend(slot)
            return
        exitcode = proc.exitcode if proc is not None else None
        what = (
            f"hung for more than timeout_s={self.timeout_s}"
            if hung
            else f"died ({describe_exit(exitcode)})"
        )
        if not hung and not slot.ready():
            what += (
                f" while starting up (start method '{self.pool.start_method}'; with forkserver "
                'or spawn the main script must be guarded by `if __name__ == "__main__":` and '
                "stage functions importable)"
            )
        stage = None
        if stage_index is not None and 0 <= stage_index < len(self.chain.specs):
            stage = self.chain.specs[stage_index].name
        self.stats.restarts += 1
        self.stats.epoch_restarts += 1
        where = (
            f" on item seq {seq}" + (f" in stage '{stage}'" if stage else "")
            if seq is not None
            else ""
        )
        logger.warning("worker %d %s%s; replacing it", slot.index, what, where)
        if self.stats.epoch_restarts > self.max_restarts:
            self.broken = True
            msg = (
                f"worker {slot.index} {what}{where}; that is {self.stats.epoch_restarts} worker "
                f"restarts this epoch, more than max_restarts={self.max_restarts}."
            )
            raise WorkerError(msg, stage=stage, seq=seq, exitcode=exitcode)
        if seq is not None:
            self.strikes[seq] += 1
            if self.strikes[seq] > self.item_retries:
                self._poison(seq, stage, what, exitcode)
        self._replace_and_resend(slot)

    def _replace_and_resend(self, slot: Slot) -> None:
        """A fresh worker in ``slot``; the feeder re-sends its unfinished chunks."""
        with slot.send_lock:
            self.pool.replace(slot)
        with self.cond:
            self.resend.extend(
                c for c in self.pending if c.slot == slot.index and c.closed and c.result is None
            )
            self.cond.notify_all()

    def _poison(self, seq: int, stage: str | None, what: str, exitcode: int | None) -> None:
        verb = "hung" if what.startswith("hung") else "killed"
        text = f"item seq {seq} {verb} {self.strikes[seq]} workers (last: worker {what})"
        if stage:
            text += f" in stage '{stage}'"
        if self.on_error == "skip":
            with self.lock:
                for chunk in self.pending:
                    if chunk.first_seq <= seq < chunk.first_seq + len(chunk.items):
                        chunk.skip.add(seq - chunk.first_seq)
            self.stats.skipped += 1
            logger.warning("skipping %s", text)
            return
        self.broken = True
        msg = (
            f"{text}; it was retried {self.item_retries} time(s) on a fresh worker "
            "(WorkerConfig.item_retries). Fix the item or use on_error='skip'."
        )
        raise WorkerError(msg, stage=stage, seq=seq, exitcode=exitcode)

    def worker_states(self) -> list[Any]:
        """Ask every worker for its stateful stages' state (a control message)."""
        self.states = {}
        for slot in self.pool.slots:
            with slot.send_lock:
                if slot.conn is not None:
                    try:
                        transport.send(slot.conn, (MSG_STATES,))
                    except (OSError, EOFError):
                        pass
        deadline = time.monotonic() + 30.0
        while len(self.states) < len(self.pool.slots) and time.monotonic() < deadline:
            self._poll(POLL_S)
        return [self.states.get(i, {}) for i in range(len(self.pool.slots))]

    def stop(self) -> None:
        super().stop()
        self._eof: list[Connection] = []
        self.pool.set_run(self.run_id + 1)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self.feeder.is_alive() and time.monotonic() < deadline:
            self._drain(0.01)
            self.feeder.join(0.0)
        if self.feeder.is_alive():
            # The feeder is blocked sending to a stuck worker: kill the workers.
            for slot in self.pool.slots:
                kill_now(slot.process)
            self.feeder.join(2.0)
        self.pool.close_retired()

    def _drain(self, timeout: float) -> None:
        conns = [s.conn for s in self.pool.slots if s.conn is not None and s.conn not in self._eof]
        for conn in wait(conns, timeout):
            try:
                transport.recv(conn)  # type: ignore[arg-type]
            except Exception:  # EOF, or a pipe whose framing was lost
                self._eof.append(conn)  # type: ignore[arg-type]
