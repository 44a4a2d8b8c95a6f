"""A main process that is SIGKILLed while its workers send tensors through
their shared-memory rings.

``python tests/scripts/ring_main.py START_METHOD`` prints the worker pids and the
bytes received through the rings so far on one line, then kills itself.
"""

from __future__ import annotations

import os
import signal
import sys

import centralpipe as cp
from tests.fns.ring_faults import tensor_of


def main() -> None:
    pipe = cp.Pipeline.from_iterable(range(100_000)).dispatch().map(tensor_of)
    # Results through the rings: none run inline while a forkserver starts.
    workers = cp.WorkerConfig(
        num_workers=2, start_method=sys.argv[1], chunk_size=4, start_inline=False
    )
    loader = cp.Loader(pipe, cp.LoaderConfig(workers=workers))
    for i, t in enumerate(loader):
        assert float(t[0]) == i and float(t[-1]) == i
        if i == 200:
            ring = loader.metrics()["dispatch"]["transport"]["shared_memory_bytes"]
            print(" ".join(map(str, loader.worker_pids())), ring, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
