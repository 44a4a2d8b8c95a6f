"""A training process that dies abruptly (SIGKILL) while its central service is busy.

``python tests/scripts/service_main.py`` prints the service's pid, waits for a line
on stdin while its main thread waits for an output (item 0 never ends in the
service's worker), then kills itself.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import centralpipe as cp


def busy(x: int) -> int:
    """Item 0 never ends (a sleep in a worker)."""
    if x == 0:
        time.sleep(600)
    return x


def main() -> None:
    pipe = cp.Pipeline.from_iterable(range(4)).dispatch().map(busy)
    config = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=1, start_method="fork", chunk_size=1),
        central="service",
    )
    loader = cp.Loader(pipe, config)
    service: int = loader._central.service_pid  # type: ignore[attr-defined]
    print(service, flush=True)

    def die() -> None:
        sys.stdin.readline()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die, daemon=True).start()
    next(iter(loader))


if __name__ == "__main__":
    main()
