"""What runs in a worker (a process, or a thread with ``executor="thread"``):
the worker loop (``loop``) and the worker stages it applies to one chunk
(``chain``, also run inline without workers). Like everything they import,
they never import torch or the builder (:mod:`centralpipe.plan.pipeline`) or
the central stages; importing this package imports neither module."""
