"""CPU priority of the helper processes, so they do not slow the training loop.

The helpers of ``central="service"`` and ``central="node"`` (the service and
its workers) run at a lower CPU priority than the training process:
:data:`NICENESS` points above the niceness they started with. On a machine
with few cores they and the training loop compete for CPU; the kernel then
runs the loop's Python first, and the data path still keeps up, because a
training loop waits for the device for most of each step (with the GIL and
the CPU released). The user's own process is never reniced, and nothing is
raised above what the kernel allows (a niceness only goes up).

The service also shortens its GIL switch interval
(:data:`~centralpipe.dispatch.timeouts.SERVICE_SWITCH_INTERVAL_S`), so its
threads (the feeder, the supervisor, the replies) hand the GIL over quickly
instead of holding a reply or a query behind a 5 ms slice.
"""

from __future__ import annotations

import contextlib
import os
import sys

from centralpipe.dispatch import timeouts

__all__ = ["NICENESS", "lower_helper", "match", "niceness"]

#: Niceness points a helper process (the service of ``central="service"`` or
#: ``"node"``, and its workers) adds to the one it started with.
NICENESS = 10


def niceness(pid: int = 0) -> int:
    """The niceness of ``pid`` (0: this process)."""
    return os.getpriority(os.PRIO_PROCESS, pid)


def lower_helper() -> None:
    """In a service process, first thing: lower its CPU priority by
    :data:`NICENESS` and shorten its GIL switch interval. Its workers inherit
    the niceness (and :func:`match` it however they were started)."""
    with contextlib.suppress(OSError):  # not allowed here: keep the priority
        os.nice(NICENESS)
    sys.setswitchinterval(timeouts.SERVICE_SWITCH_INTERVAL_S)


def match(pid: int) -> None:
    """In a worker: be at least as nice as ``pid``, the process it serves
    (a forkserver or spawn parent may have started it at another
    niceness). Never lowers this process's niceness."""
    with contextlib.suppress(OSError):
        target = niceness(pid)
        current = niceness()
        if target > current:
            os.nice(target - current)
