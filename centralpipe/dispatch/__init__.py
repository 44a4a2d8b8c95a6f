"""The dispatch boundary: ordered streams over a pool of stateless workers.

Modules, by role:

- ``protocol``   messages, chunks, results, status slots; the only user of
  ``transport`` (serialisation and framing), so a transport plugs in there.
- ``transport``  serialisation and framing of one message.
- ``chain``      the worker stages run over one chunk (in a worker or inline).
- ``worker``     the worker loop (a process target).
- ``pool``       worker processes: start, replace, shut down.
- ``sender``     pulling chunks from the central chain; the feeder thread
  that sends them round-robin; the inline driver.
- ``reorder``    a :class:`~centralpipe.dispatch.reorder.Stream`: in-order
  delivery and the checkpoint capture of in-flight inputs.
- ``supervisor`` receiving results; deaths, hangs, poison items, restarts.
- ``boundary``   assembling a stream with its driver (the Loader's entry).

The concurrency story
---------------------

Threads: the *consumer* (the caller iterating the Loader), and with
``num_workers > 0`` one *feeder* thread per run. Processes: ``num_workers``
workers, each with one duplex pipe and a shared status array.

Who runs what:

- The central chain (every central stage's ``next()``) runs in exactly one
  thread at a time, always under ``Stream.lock``: the feeder with workers, the
  consumer inline. Only the feeder sends chunks (and re-sends the chunks of a
  replaced worker), so it alone may block on a full pipe.
- The consumer receives every result (``Supervisor._poll``), so no worker
  blocks on its output pipe for long while the consumer waits for another;
  results are stashed on their chunks and delivered in ``seq`` order.
- ``state_dict()``, ``query()`` and ``metrics()`` read under ``Stream.lock``
  (``Stream.reading``): the feeder releases it at least every
  ``LOCK_SLICE_S`` between items, and yields to a waiting reader.

Who blocks on what, and the bound:

- feeder, buffer full: ``Stream.cond.wait(POLL_S)`` in a loop that re-checks
  ``stopping`` and the re-send queue;
- feeder, pipe full: ``send_bytes`` to one worker; ended by that worker
  reading, dying, or by ``Supervisor.stop`` killing it after
  ``STOP_TIMEOUT_S``;
- consumer, waiting for the head chunk: ``multiprocessing.connection.wait``
  on every pipe and process sentinel for at most ``POLL_S``, then liveness
  and ``timeout_s`` deadlines are checked;
- workers: ``recv`` on their pipe (EOF when the main process closes it or
  dies; a watchdog thread exits a worker whose parent is gone).

Invariants (``Stream.lock``): every item the central chain produced is
delivered or in a pending chunk; ``in_flight`` counts the items dispatched and
not yet retired and is ``<= buffer_size``; a chunk's ``sent_gen`` equals its
slot's generation iff the current worker of that slot has it or is being sent it.

Shutdown escalates (``Supervisor.stop``, then ``WorkerPool.close``): mark the
run stopped and abandoned (``current_run``, so workers skip queued chunks) →
drain the pipes until the feeder exits (``STOP_TIMEOUT_S``) → kill workers if
it is stuck in a send → close our pipe ends (workers read EOF) → join
(``_JOIN_TIMEOUT_S``) → terminate (``_TERMINATE_TIMEOUT_S``) → kill
(``_KILL_TIMEOUT_S``). ``close()`` is idempotent and a ``weakref.finalize``
runs it if the Loader is garbage collected.
"""
