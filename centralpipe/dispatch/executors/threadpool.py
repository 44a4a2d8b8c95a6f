"""Worker threads: the executor that runs worker stages in this process.

Threads cannot be killed: they get an end-of-input marker and are joined
briefly; a thread stuck in user code is left behind as a daemon thread.
"""

import queue
import threading
import types
from typing import Any

from centralpipe.dispatch import timeouts
from centralpipe.dispatch.budget import estimate_nbytes
from centralpipe.dispatch.executors.pool import ABANDON_ALL, Event, Executor, Slot
from centralpipe.dispatch.wire import protocol
from centralpipe.dispatch.wire.protocol import (
    MSG_RESULT,
    MSG_STATES,
    STATUS_LEN,
    Encoded,
)
from centralpipe.dispatch.worker.loop import WorkerSpec, serve

__all__ = ["ThreadPool"]


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
        # over a result, re-checking every timeouts.PAUSE_POLL_S.
        self._paused: frozenset[int] = frozenset()
        self._resume = threading.Condition()
        #: Messages an earlier reader took after a later one claimed the
        #: workers (see ``Executor.claim``): the new reader's, read first.
        self._unclaimed: list[tuple[int, int, Any] | None] = []

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
                    self._resume.wait(timeouts.PAUSE_POLL_S)
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

    def wait(
        self, timeout: float, paused: frozenset[int] = frozenset(), reader: object = None
    ) -> list[Event]:
        if reader is not self.reader:
            return []
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
        with self.read_lock:
            if reader is not self.reader:
                # A later run claimed the workers while this one waited: what
                # it took is that run's; left for it (see ``claim``).
                self._unclaimed.extend(got)
                self.outbox.put(None)  # its wait, if in progress, looks again
                return events
            got[:0] = self._unclaimed
            self._unclaimed.clear()
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
                slot.process.join(timeouts.THREAD_JOIN_TIMEOUT_S)
                slot.process = None
        self.shut = True
