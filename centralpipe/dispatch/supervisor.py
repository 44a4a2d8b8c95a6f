"""Supervision: receiving results, deaths, hangs, poison items and restarts.

The :class:`Supervisor` is a stream's :class:`~centralpipe.dispatch.reorder.Driver`
when workers run it. The consumer thread, waiting for the head chunk, receives
results from every worker (stashing them on their chunks, so no worker ever
blocks on a full pipe while the consumer waits for another), watches process
sentinels and per-item deadlines, replaces dead or hung workers and has the
:class:`~centralpipe.dispatch.sender.Feeder` re-send their unfinished chunks.
An item that killed or hung ``item_retries + 1`` workers is a poison item:
skipped (``on_error="skip"``) or reported as a ``WorkerError``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from multiprocessing.connection import Connection, wait
from typing import Any

from centralpipe.dispatch import protocol
from centralpipe.dispatch.pool import Slot, WorkerPool, describe_exit, kill_now
from centralpipe.dispatch.protocol import MSG_RESULT, MSG_STATES, Chunk, StageFailure
from centralpipe.dispatch.reorder import Driver, Stream, logger
from centralpipe.dispatch.sender import Feeder
from centralpipe.errors import WorkerError

__all__ = ["Supervisor"]

#: Longest single wait for worker results before re-checking liveness.
POLL_S = 0.1
#: How long stopping a run may take before stuck workers are killed.
STOP_TIMEOUT_S = 5.0
#: How long worker_states() waits for every worker's answer.
STATES_TIMEOUT_S = 30.0


class Supervisor(Driver):
    """Receives a stream's results from the pool; see the module docstring."""

    def __init__(
        self,
        stream: Stream,
        *,
        pool: WorkerPool,
        run_id: int,
        timeout_s: float | None,
        max_restarts: int,
        item_retries: int,
    ) -> None:
        self.stream = stream
        self.pool = pool
        self.run_id = run_id
        self.timeout_s = timeout_s
        self.max_restarts = max_restarts
        self.item_retries = item_retries
        self.strikes: dict[int, int] = defaultdict(int)
        self.states: dict[int, Any] = {}
        self._eof: list[Connection] = []
        self.feeder = Feeder(stream, pool, run_id)
        pool.set_run(run_id)
        pool.ensure_alive()
        self.feeder.start()

    def wait_head(self) -> Chunk | None:
        s = self.stream
        started = time.perf_counter()
        try:
            while True:
                with s.lock:
                    if s.pending:
                        head = s.pending[0]
                        if head.closed and head.result is not None:
                            return head
                    elif s.exhausted:
                        return None
                if self.feeder.error is not None:
                    raise RuntimeError("centralpipe feeder thread failed") from self.feeder.error
                self._poll(POLL_S)
        finally:
            s.stats.wait_workers_s += time.perf_counter() - started

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
                    msg = protocol.recv(obj)
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
            chunk = self.stream.by_cid.get(cid)
            if chunk is None or chunk.result is not None:
                return
            if isinstance(result.outputs, protocol.Undecodable):
                # An item or an output cannot be unpickled on its way: find
                # which by sending the chunk again, item by item.
                self._resend_per_item(chunk)
                return
            if chunk.per_item:
                stage = self.stream.chain.specs[-1].name if self.stream.chain.specs else None
                result = protocol.unseal_outputs(result, stage, self.stream.dispatch_name)
            self.stream.stats.items_per_worker[slot.index] += len(chunk.items)
            chunk.result = self.stream.accept(chunk, result)
        elif msg[0] == MSG_STATES:
            self.states[slot.index] = msg[1]

    def _recover(self, slot: Slot, *, hung: bool, desynced: bool = False) -> None:
        """A worker died or hung: replace it and have its chunks re-sent."""
        seq, stage_index, _ = slot.busy_seq()
        if seq is not None and not any(
            c.first_seq <= seq < c.first_seq + len(c.items) for c in self.stream.pending
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
        if stage_index is not None and 0 <= stage_index < len(self.stream.chain.specs):
            stage = self.stream.chain.specs[stage_index].name
        stats = self.stream.stats
        stats.restarts += 1
        stats.epoch_restarts += 1
        where = (
            f" on item seq {seq}" + (f" in stage '{stage}'" if stage else "")
            if seq is not None
            else ""
        )
        logger.warning("worker %d %s%s; replacing it", slot.index, what, where)
        if stats.epoch_restarts > self.max_restarts:
            self.stream.broken = True
            msg = (
                f"worker {slot.index} {what}{where}; that is {stats.epoch_restarts} worker "
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
        with self.stream.cond:
            self.feeder.resend.extend(
                c
                for c in self.stream.pending
                if c.slot == slot.index and c.closed and c.result is None
            )
            self.stream.cond.notify_all()

    def _resend_per_item(self, chunk: Chunk) -> None:
        if chunk.per_item:  # cannot happen: each item is sealed on its own
            raise RuntimeError(f"chunk {chunk.cid} cannot be decoded even item by item")
        with self.stream.cond:
            chunk.per_item = True
            chunk.sent_gen = -1
            self.feeder.resend.append(chunk)
            self.stream.cond.notify_all()

    def _poison(self, seq: int, stage: str | None, what: str, exitcode: int | None) -> None:
        verb = "hung" if what.startswith("hung") else "killed"
        text = f"item seq {seq} {verb} {self.strikes[seq]} workers (last: worker {what})"
        if stage:
            text += f" in stage '{stage}'"
        if self.stream.on_error == "skip":
            with self.stream.lock:
                for chunk in self.stream.pending:
                    if chunk.first_seq <= seq < chunk.first_seq + len(chunk.items):
                        chunk.skip.add(seq - chunk.first_seq)
            self.stream.stats.skipped += 1
            logger.warning("skipping %s", text)
            return
        msg = (
            f"{text}; it was retried {self.item_retries} time(s) on a fresh worker "
            "(WorkerConfig.item_retries). Fix the item or use on_error='skip'."
        )
        # Not raised here: the chunk is re-sent without the item, and the
        # error is raised in its place, after every item before it.
        with self.stream.lock:
            for chunk in self.stream.pending:
                if chunk.first_seq <= seq < chunk.first_seq + len(chunk.items):
                    at = seq - chunk.first_seq
                    failure = StageFailure(at, stage, "", "", "", text=msg, exitcode=exitcode)
                    chunk.unsendable.append(failure)

    def worker_states(self) -> list[Any]:
        """Ask every worker for its stateful stages' state (a control message)."""
        self.states = {}
        for slot in self.pool.slots:
            with slot.send_lock:
                if slot.conn is not None:
                    try:
                        protocol.send(slot.conn, (MSG_STATES,))
                    except (OSError, EOFError):
                        pass
        deadline = time.monotonic() + STATES_TIMEOUT_S
        while len(self.states) < len(self.pool.slots) and time.monotonic() < deadline:
            self._poll(POLL_S)
        return [self.states.get(i, {}) for i in range(len(self.pool.slots))]

    def stop(self) -> None:
        self._eof = []
        self.pool.set_run(self.run_id + 1)
        thread = self.feeder.thread
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while thread.is_alive() and time.monotonic() < deadline:
            self._drain(0.01)
            thread.join(0.0)
        if thread.is_alive():
            # The feeder is blocked sending to a stuck worker: kill the workers.
            for slot in self.pool.slots:
                kill_now(slot.process)
            thread.join(2.0)
        self.pool.close_retired()

    def _drain(self, timeout: float) -> None:
        conns = [s.conn for s in self.pool.slots if s.conn is not None and s.conn not in self._eof]
        for conn in wait(conns, timeout):
            try:
                protocol.recv(conn)  # type: ignore[arg-type]
            except Exception:  # EOF, or a pipe whose framing was lost
                self._eof.append(conn)  # type: ignore[arg-type]
