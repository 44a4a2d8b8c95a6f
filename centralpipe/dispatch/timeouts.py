"""Every time bound of the dispatch machinery, in seconds, in one place.

Each constant says what it bounds and why it has its value. The modules read
them here at the moment they wait (``timeouts.NAME``, never a copy made at
import), so a test (or a user in an emergency) changes one bound by setting
it on this module. Worker processes import this module too: it imports
nothing.

The one bound a user meets in normal use, the wait of ``state_dict()``,
``query()``, ``load_state_dict()`` and the start of a pass for a central
``next()`` in progress, is public: :data:`centralpipe.config.CENTRAL_WAIT_S`.
"""

from __future__ import annotations

__all__ = [
    "ACCEPT_TIMEOUT_S",
    "CANCEL_JOIN_TIMEOUT_S",
    "FIND_TIMEOUT_S",
    "FLUSH_S",
    "FORK_POLL_S",
    "HANDSHAKE_TIMEOUT_S",
    "JOIN_TIMEOUT_S",
    "KILL_TIMEOUT_S",
    "LOCK_SLICE_S",
    "PAUSE_POLL_S",
    "PIN_CLOSE_TIMEOUT_S",
    "PIN_POLL_S",
    "POLL_S",
    "ROOM_WAIT_S",
    "SERVICE_CLOSE_TIMEOUT_S",
    "SERVICE_POLL_S",
    "SERVICE_SWITCH_INTERVAL_S",
    "SERVICE_WATCHDOG_S",
    "STALL_TIMEOUT_S",
    "STARTUP_GRACE_S",
    "START_GRACE_S",
    "START_TIMEOUT_S",
    "STATES_TIMEOUT_S",
    "STOP_TIMEOUT_S",
    "TARGET_CHUNK_S",
    "TARGET_RANGE_CHUNK_S",
    "TERMINATE_TIMEOUT_S",
    "THREAD_JOIN_TIMEOUT_S",
    "WORKER_WATCHDOG_S",
]

# -- one pass: the central thread, the consumer, the supervisor ----------------

#: Longest single wait of any thread of a pass (central thread, consumer,
#: supervisor) before it re-checks for a stop and for errors: short enough
#: that stopping a pass is never noticed late, long enough to cost nothing.
POLL_S = 0.1
#: How long stopping a pass waits for its central thread to leave a send
#: before the workers it may be blocked on are killed: a send to a live
#: worker ends as soon as that worker reads, well within this.
STOP_TIMEOUT_S = 5.0
#: How long ``worker_states()`` waits for every worker's answer: a worker
#: answers between chunks, after the chunk it is on (user code).
STATES_TIMEOUT_S = 30.0
#: With ``timeout_s`` set, how long a worker that owes results may take to
#: start up (imports in a fresh process take seconds on a loaded machine).
STARTUP_GRACE_S = 30.0
#: How long a thread whose ``start()`` was interrupted (Ctrl-C) may take to
#: show up before a join gives up on it; one that shows up later finds its
#: run stopped and ends at once.
START_GRACE_S = 0.2
#: How often the consumer, waiting for the pin thread (``pin_memory=True``),
#: checks for a stop.
PIN_POLL_S = 0.1
#: How long ``close()`` waits for the pin thread to finish its current chunk.
PIN_CLOSE_TIMEOUT_S = 5.0

# -- pulling from the central chain -------------------------------------------

#: A chunk being filled is sent after this long even if not full: a slow
#: source still feeds the workers (latency over chunk size).
FLUSH_S = 0.02
#: The central thread releases the chain lock at least this often while
#: pulling, so ``state_dict()`` and ``query()`` wait for one item, not a chunk.
LOCK_SLICE_S = 0.0005
#: Work per chunk the adaptive chunk size aims at: large enough to amortise
#: one pipe message, small enough to keep every worker busy.
TARGET_CHUNK_S = 0.005
#: The same for a chunk that is a range of lines read by the worker
#: (``read_lines`` into a parallel stage): its main-process cost is per
#: chunk (a range out, results back, ordered delivery), not per line, so
#: it aims at more work per chunk; the buffer and result-byte limits still
#: bound it (``dispatch.pull``).
TARGET_RANGE_CHUNK_S = 0.02

# -- worker processes and threads (executors) ----------------------------------

#: ``close()``: how long a worker process may take to exit once its pipe is
#: closed (it reads EOF between chunks) before it is terminated.
JOIN_TIMEOUT_S = 2.0
#: How long a terminated (SIGTERM) worker process may take to exit before
#: it is killed.
TERMINATE_TIMEOUT_S = 1.0
#: How long a killed (SIGKILL) worker process may take to be reaped.
KILL_TIMEOUT_S = 5.0
#: How often the main thread looks whether a step it handed to a helper
#: thread (forking a worker) is done: the step takes milliseconds.
FORK_POLL_S = 0.0005
#: How long cancelling the background start of the workers waits for a
#: start in progress: it waits on the forkserver, which finishes its imports
#: first (seconds under heavy load).
CANCEL_JOIN_TIMEOUT_S = 60.0
#: How long ``close()`` waits for each worker thread (``executor="thread"``)
#: to end; one stuck in user code is left as a daemon.
THREAD_JOIN_TIMEOUT_S = 1.0
#: How often a worker thread paused by the byte bound (``buffer_bytes``)
#: re-checks whether it may hand over its result.
PAUSE_POLL_S = 0.1

# -- inside a worker process (torch-free) -------------------------------------

#: How often a worker process checks that the main process is still alive
#: (it exits once it is gone, even inside user code).
WORKER_WATCHDOG_S = 0.25
#: How long a worker waits for room in its shared-memory ring while the main
#: process is using earlier results, before it sends the buffer on its pipe
#: instead: a short wait, as the pipe is always a way out.
ROOM_WAIT_S = 0.05

# -- central="service" and central="node" -------------------------------------

#: Longest wait of the client for the service to start and build the
#: pipeline's stages (a fresh interpreter importing torch: seconds).
START_TIMEOUT_S = 120.0
#: Longest wait for the service to exit once asked to, before it is killed.
SERVICE_CLOSE_TIMEOUT_S = 10.0
#: How often the client's waits re-check that the service lives.
SERVICE_POLL_S = 0.5
#: The service process's GIL switch interval (``sys.setswitchinterval``;
#: Python's default is 5 ms). A request thread woken by a ``query()`` or
#: ``metrics()`` waits for the GIL while the feeder runs the central chain,
#: and a running thread is asked to let go only after this long: at 5 ms
#: every read took milliseconds. Threads that run without a waiter are not
#: interrupted, so a short interval costs only where a reply is waiting.
SERVICE_SWITCH_INTERVAL_S = 0.0002
#: How long the service waits for its client(s) to connect.
ACCEPT_TIMEOUT_S = 60.0
#: How often the service's watchdog checks that its client lives.
SERVICE_WATCHDOG_S = 0.5
#: Longest wait for each message of the authentication exchange (a peer
#: that sends nothing is not one of ours).
HANDSHAKE_TIMEOUT_S = 10.0
#: Longest wait of a rank for a stalled local rank (full window, an epoch
#: change, a load) before a ``ServiceError`` naming it.
STALL_TIMEOUT_S = 60.0
#: How long a local rank waits for the token file of local rank 0's service.
FIND_TIMEOUT_S = 120.0
