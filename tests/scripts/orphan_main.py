"""A main process that dies abruptly (SIGKILL) while its worker is busy.

``python tests/scripts/orphan_main.py START_METHOD MODE`` prints the worker pids on
one line, then kills itself. ``MODE``: ``gil`` — the main thread iterates and
the worker is inside a C call that holds the GIL; ``thread`` — a helper thread
iterates and the worker sleeps in Python code.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

import centralpipe as cp


def busy(x: int) -> int:
    """Item 0 never ends: a regex that backtracks for hours holding the GIL,
    or a long sleep."""
    if x == 0:
        if os.environ.get("ORPHAN_MODE") == "gil":
            re.match(r"(a+)+$", "a" * 40 + "b")
        else:
            time.sleep(600)
    return x


def _report_and_die(loader: cp.Loader[int]) -> None:
    deadline = time.monotonic() + 60
    while not loader.worker_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the worker is inside busy(0) by now
    print(" ".join(map(str, loader.worker_pids())), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    start_method, mode = sys.argv[1], sys.argv[2]
    os.environ["ORPHAN_MODE"] = mode
    pipe = cp.Pipeline.from_iterable(range(4)).dispatch().map(busy)
    config = cp.LoaderConfig(
        # Item 0 must run in the worker, not inline while a forkserver starts.
        workers=cp.WorkerConfig(
            num_workers=1, start_method=start_method, chunk_size=1, start_inline=False
        )
    )
    loader = cp.Loader(pipe, config)
    if mode == "gil":
        threading.Thread(target=_report_and_die, args=(loader,), daemon=True).start()
        next(iter(loader))
    else:
        threading.Thread(target=lambda: next(iter(loader)), daemon=True).start()
        _report_and_die(loader)


if __name__ == "__main__":
    main()
