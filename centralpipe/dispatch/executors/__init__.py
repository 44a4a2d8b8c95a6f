"""The executors: where the workers run. ``pool`` is what both share (worker
slots, events, the interface the supervisor and the streams use);
``procpool`` runs worker processes (start, replace, shut down; the
forkserver), ``threadpool`` worker threads in this process. Their start-up:
``preload`` (what the forkserver imports before it forks) and ``starter``
(starting the worker processes in the background once the Loader exists)."""
