"""Ordered streams over one pool of stateless workers.

A *stream* is one boundary where central items leave the central chain for
the workers and come back in order: the dispatch boundary, and each parallel
central stage (``map/filter/flat_map(..., parallel=True)``). All the streams
of a pass share one executor (processes or threads) and one supervisor.

Modules, by role. ``[worker]``: runs in worker processes too (the worker loop
and all it imports): never imports torch, the builder or the central stages,
a rule ``tests/project/test_layout.py`` checks. Every other module runs in the main
process only.

Main process, one pass of the Loader:

- ``central``   the Loader's one entry: the surface of its central part
  (start / next / state / load / query / metrics / stop / close), so that
  part can run in this process or elsewhere without the Loader knowing.
- ``local``     that part in this process: the central stages, the worker
  pool, the runs and the pending checkpoint.
- ``service``   ``central="service"``: that part in one helper process (the
  service's side: its request loop, its watchdog).
- ``client``    the thin client of a service that the Loader keeps (outputs
  through a shared-memory ring).
- ``rendezvous`` finding and trusting a service: the private socket
  directory of the job, peer credentials, the token handshake.
- ``node``      ``central="node"``: the stages before ``shard()`` shared by
  a node's local ranks (their window, each rank's shard, the node-local load).
- ``noderank``  one local rank's central part in the node's service (its
  dispatch stream, its per-rank state).
- ``nodepool``  the shared stages' parallel streams on the node-wide pool.
- ``nodeservice`` the node's service process and its clients (local rank 0
  starts it; the token file for the others).
- ``run``  assembling a run of every stream (``Run``).
- ``segments``  consecutive parallel stages fused into one stream (``Segment``).
- ``warm``      the inline warm start: the first chunks run in the main process
  while the workers start.
- ``pull``      pulling a chunk from the central chain into a stream.
- ``pullstate`` the pull's part of a stream's state: the checkpoint's in-flight
  inputs to dispatch again first, its burst (``Stream.pulls``).
- ``sender``    sending chunks round-robin; the drivers (inline, feeder
  thread, parallel stage).
- ``reorder``   a :class:`~centralpipe.dispatch.reorder.Stream`: in-order
  delivery of its results.
- ``capture``   the checkpoint capture of a stream's in-flight inputs: a
  collaborator that reads the stream (``Stream.checkpoint``), never a mixin.
- ``chunk``     a :class:`~centralpipe.dispatch.chunk.Chunk`: consecutive items
  of a stream from their pull to their delivery, and every change of its state.
- ``stamps``    the ``count``/``shard`` totals each dispatched item carries.
- ``supervisor`` receiving every result; deaths, hangs, poison items, restarts.
- ``budget``    the bytes of results held before their turn, and the bound
  on them (``buffer_bytes``): which streams may send, which workers are read.
- ``chainlock``     the chain lock, the one lock held across user code, and
  the bounded waits on it.
- ``pinning``   pinning delivered tensors (``pin_memory=True``) in a thread.
- ``priority`` [worker] the CPU priority of the helpers of ``"service"`` and
  ``"node"`` (a service and its workers run nicer than the training process).
- ``timeouts`` [worker] every time bound of the machinery, in seconds, with
  what it bounds and why that value (read at each wait; imports nothing).

``executors/``, where the workers run (main process):

- ``executors.pool``       what the executors share: slots, events, the interface.
- ``executors.procpool``   worker processes: start, replace, shut down; the forkserver.
- ``executors.threadpool`` worker threads in this process.
- ``executors.preload``    what the forkserver imports before it forks a worker.
- ``executors.starter``    starting the worker processes in the background.

``wire/``, what both processes share (torch-free):

- ``wire.protocol`` [worker] messages (a chunk's items, results), worker status slots;
  the only user of ``transport``, so another transport plugs in there.
- ``wire.transport`` [worker] serialisation and framing of one message.
- ``wire.plain`` [worker] results that are plain tensors and arrays in the ring,
  described in a table of integers instead of pickled.
- ``wire.ringreader`` [worker] each worker process's shared-memory ring for large
  result buffers (anonymous memory handed over on its pipe; only ring offsets
  travel on the pipe; lent to the received tensors and arrays without a
  copy, released when they are freed).
- ``wire.ringwriter`` [worker] the worker's side of its ring: free space, and large
  outputs moved into the ring as the worker stages make them.
- ``wire.tokens`` [worker] lists of 1-D arrays or tensors (token data: a
  chunk's outputs, a bucket) sent as one flat buffer plus offsets.

``worker/``, what runs in a worker:

- ``worker.loop`` [worker] the worker loop, for a process or a thread.
- ``worker.chain`` [worker] the worker stages run over one chunk (in a worker
  or inline).
- ``worker.ranges`` [worker] byte ranges of a file that a worker reads and
  splits into lines as ``read_lines`` does, for the parallel stage after it.

The concurrency story
---------------------

Threads: the *consumer* (the caller iterating the Loader); with workers and
worker stages after ``dispatch()``, one *feeder* thread per run; with any
workers, one *supervisor* thread per run; thread workers with
``executor="thread"``. Processes: ``num_workers`` workers with the process
executor, each with one duplex pipe and a shared status array.

Who runs what:

- The central chain (every central stage's ``next()``, parallel stages
  included) runs in exactly one thread at a time — the feeder, or without one
  the consumer — always under the Loader's *chain lock* (``chainlock``), the only
  lock ever held across user code. It outlives runs: a stopped run's feeder
  still inside a blocking ``next()`` keeps it until that call returns and
  then pulls nothing more, so a new pass never runs the chain beside it.
  That thread is the only one that sends chunks, for every stream, and
  re-sends the chunks of replaced workers; a parallel stage's ``next()``
  pulls, sends and waits for its own head result in that thread.
- The supervisor thread is the only reader of results: it puts each on its
  chunk (without taking any stream's lock), and detects deaths (sentinels),
  hangs (``timeout_s`` from the start of an item, or a worker that owes
  results and does not start them) and replaces workers. It never sends a
  chunk, so it never blocks on a full pipe, and workers never block long on
  their output.
- Each stream also has a bookkeeping ``lock`` (pending chunks, counters,
  delivery position), held for a few statements only, never across user
  code: taking a result, retiring a chunk, stopping a run, ``metrics()`` and
  ``query(delivered=True)`` never wait for the central chain.
- ``state_dict()``, ``query()``, ``load_state_dict()`` and the start of a
  pass read or reset central stages, so they hold the chain lock
  (``Stream.reading``): the central thread releases it at least every
  ``LOCK_SLICE_S`` between items and yields to a waiting reader, but one
  ``next()`` of the chain is atomic (a stage's state mid-call is not a
  position) — a source blocked on a read, or a parallel stage waiting for a
  hung worker, holds it. They wait at most ``centralpipe.config.CENTRAL_WAIT_S`` (60 s),
  then raise ``TimeoutError`` naming the stage (read from the threads'
  stacks), having changed nothing: never an inexact state.

Who blocks on what, and the bound (every bound is in ``timeouts``, with its
unit and reason; every wait is at most ``POLL_S`` and
re-checks for stop and errors; ``Supervisor.wake`` is the one condition that
results, re-sends, errors and room in a buffer notify):

- central thread, buffer full (in items, or in bytes: ``budget``) or waiting
  for a parallel stage's result: ``Supervisor.wake.wait_unless(..., POLL_S)``;
- central thread, pipe full: ``send_bytes`` to one worker; ended by that
  worker reading (its output is always read), dying, or being killed by
  ``Supervisor.stop`` after ``STOP_TIMEOUT_S``;
- consumer, waiting for the head chunk: ``Supervisor.wake.wait_unless(..., POLL_S)``;
- supervisor: ``multiprocessing.connection.wait`` on every pipe, process
  sentinel and a wake-up pipe (``POLL_S``), or a queue ``get`` for threads.
  At the byte bound it leaves some workers' pipes unread, never one that owes
  the first chunk without a result of a stream, nor one being sent to;
- a worker left unread by the byte bound: its ``send`` (a process) or its
  hand-over (a thread, re-checked every 0.1 s), until the consumer catches up;
- workers: ``recv`` on their pipe (EOF when the main process closes it or
  dies; a watchdog thread exits a worker whose parent is gone). Neither side
  ever waits on a shared-memory ring: a worker with no room sends the buffer
  on its pipe; the supervisor's release of ring space never blocks (a full
  release pipe keeps it for the next ``wait``).

Invariants: every item a stream pulled is delivered or in one of its pending
chunks (under its lock: both or neither); its ``in_flight`` counts the items
pulled and not yet retired and stays ``<= buffer_size``; a chunk's
``sent_gen`` equals its slot's generation iff that slot's current worker has
it or is being sent it; a worker's status is written by the worker alone, under a version counter
(no torn reads); a worker writes a ring buffer before sending the message that
names it and reuses ring space only once the main process has released it
(copied out, or every tensor lent on it freed), and each worker generation
gets a fresh ring (no torn or reused result, whenever a worker dies); the
delivery position of a parallel stage's stream only moves in the central
thread.

Starting a pass: the run is built (no thread) under the chain lock and
registered with the Loader *before* any thread starts (``Run.start``), so an
error or Ctrl-C anywhere in the start leaves only threads that stopping the
registered run ends; a thread whose ``start()`` was interrupted is joined
once it shows up (``chainlock.join_started``) or, showing up later, finds its run
stopped and ends without touching anything.

Shutdown escalates (``Run.stop``): mark the run abandoned (flags first, no
lock needed) and ``current_run`` (workers skip queued chunks) → wait for the
feeder (``STOP_TIMEOUT_S``) while the supervisor keeps reading, then kill
workers if it is stuck in a send (one inside a central ``next()`` is not
waited for: it leaves when that call returns) → stop the supervisor → at
``close()``:
close our pipe ends (workers read EOF) → join (``JOIN_TIMEOUT_S``) →
terminate → kill. Threads get an end-of-input marker and a short join; a
thread stuck in user code is left as a daemon. ``close()`` is idempotent and
a ``weakref.finalize`` runs it if the Loader is garbage collected. The
finalizer takes no lock: in one of the Loader's own threads (which may hold
any of its locks when garbage collection runs it) it only sets the stop flags
(``Run.abandon``) and hands the close to a ``centralpipe-closer`` thread
(:mod:`centralpipe.lifetime`).

Ctrl-C (any ``BaseException`` that is not an ``Exception``) lands only in
the consumer's thread, at a function call. Every step of the consumer's
path keeps state whole at each call, so the interrupt is raised at once and
ends nothing: only an ``Exception`` from the central chain is a stage's
failure; the items a cut-short pull got stay in a closed chunk that the next
call runs or sends first; a send cut short replaces the worker (half a
message may be in its pipe); a re-send leaves the queue only once sent; a
chunk is retired whole or not at all; the iterators are not generators (an
exception raised through a generator ends it). Every close is finished by
the next call: a resource is forgotten only once released, and every pipe
end and ring is registered as it is opened
(``tests/dispatch/test_dispatch_interrupts.py``).

A real SIGINT is handled where CPython checks for one: as a Python
function starts, on a backward jump, after a call into C returns. So every
lock the consumer takes is released at C level: the chain lock (an
``RLock``) by its own ``__exit__``, which ``with chainlock.hold(...)`` calls
without entering Python code (``chainlock.Holding``), or in a ``finally`` that
calls ``release()`` first and lets the owner check tell whether this thread
took it; the bookkeeping locks by ``with lock:``; the run's wake-up
(``chainlock.Wake``) is no ``threading.Condition``, whose Python ``__exit__``
and ``wait()`` an interrupt can cut between lock calls. Deferring SIGINT in
the critical sections instead would need a Python signal handler of ours,
which any handler the user installs later replaces, and ``pthread_sigmask``
in the main thread does not stop another thread from taking the signal.
Each position moves with no call between the move and its record (a
``for`` takes an output; ``pending`` changes last), so nothing is lost or
handed out twice (``tests/dispatch/test_real_signals.py``).

Races the design rules out (each with a test that makes it happen,
``tests/dispatch/test_by_design.py``): a status read in the middle of the worker's
write (the version counter); two readers changing the reader count at once
(``readers_lock``); Ctrl-C while the consumer waits for a result (the
consumer never reads a pipe, so no message is cut in half and nothing is
joined or replaced before the interrupt is re-raised); ``worker_states()``
while a worker's output is full (results are read by the supervisor, not
the caller, so the control message always gets through).
"""
