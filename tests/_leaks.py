"""Finding child processes and threads that a test left behind.

Linux only: processes are read from ``/proc``. Every ``/proc/<pid>/stat`` is
scanned once per call, which sees children started by any thread (the
``/proc/<pid>/task/*/children`` files can miss children of running tasks).

The multiprocessing forkserver and resource tracker are long-lived helpers
started on first use and kept for the whole session, so they are never reported
as leaks; the processes the forkserver forks for a test are, since they are
workers like any other.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterable

HELPER_MARKERS = ("forkserver", "resource_tracker")
_POLL_INTERVAL_S = 0.05


def _read_stat(pid: int) -> tuple[int, str] | None:
    """Return ``(ppid, state)`` of ``pid``, or ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')'.
    fields = data.rpartition(")")[2].split()
    if len(fields) < 2:
        return None
    return int(fields[1]), fields[0]


def _process_table() -> dict[int, tuple[int, str]]:
    """Map every visible pid to ``(ppid, state)``."""
    table: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read_stat(int(entry))
            if stat is not None:
                table[int(entry)] = stat
    return table


def cmdline(pid: int) -> str:
    """The command line of ``pid`` as one string ('' if gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def is_helper(pid: int) -> bool:
    """True for the multiprocessing forkserver and resource tracker processes."""
    line = cmdline(pid)
    return any(marker in line for marker in HELPER_MARKERS)


def child_pids(pid: int | None = None, *, include_zombies: bool = False) -> set[int]:
    """Direct children of ``pid`` (default: this process).

    Zombies (exited, not yet reaped) are left out unless ``include_zombies``.
    """
    parent = os.getpid() if pid is None else pid
    return {
        child
        for child, (ppid, state) in _process_table().items()
        if ppid == parent and (include_zombies or state != "Z")
    }


def live_descendants(pid: int | None = None) -> set[int]:
    """Running descendants of ``pid`` (default: this process), helpers excluded.

    Helpers are recognised only as direct children of ``pid``: the processes the
    forkserver forks inherit its command line, and those are workers to track.
    """
    root = os.getpid() if pid is None else pid
    table = _process_table()
    children: dict[int, list[int]] = {}
    for child, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(child)
    found: set[int] = set()
    stack = list(children.get(root, ()))
    while stack:
        current = stack.pop()
        stack.extend(children.get(current, ()))
        if table[current][1] == "Z" or (table[current][0] == root and is_helper(current)):
            continue
        found.add(current)
    return found


def describe(pids: Iterable[int]) -> str:
    """One line per pid: ``pid: cmdline``."""
    return "\n".join(f"  {pid}: {cmdline(pid) or '<exited>'}" for pid in sorted(pids))


def _reap() -> None:
    """Join finished multiprocessing children so they stop showing up.

    Other exited children stay zombies, which are not counted as running; they
    are not waited for here, since that would hide their exit status from the
    object that owns them.
    """
    multiprocessing.active_children()


def wait_for_new_processes(before: set[int], timeout_s: float) -> set[int]:
    """Wait up to ``timeout_s`` for descendants not in ``before`` to exit.

    Returns the ones still running after the wait (empty when none leaked).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        _reap()
        leaked = live_descendants() - before
        if not leaked or time.monotonic() >= deadline:
            return leaked
        time.sleep(_POLL_INTERVAL_S)


def kill_processes(pids: Iterable[int], timeout_s: float = 5.0) -> None:
    """SIGKILL ``pids`` and reap them, so one leak does not fail later tests."""
    remaining = set(pids)
    for pid in remaining:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while remaining and time.monotonic() < deadline:
        _reap()
        remaining &= live_descendants()
        if remaining:
            time.sleep(_POLL_INTERVAL_S)


def wait_for_new_threads(before: set[threading.Thread], timeout_s: float) -> list[threading.Thread]:
    """Wait up to ``timeout_s`` for new threads to end: non-daemon ones, and
    centralpipe's own (daemon) threads, whose names start with "centralpipe".

    Returns the ones still alive after the wait (empty when none leaked).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        leaked = [
            t
            for t in threading.enumerate()
            if t not in before and (not t.daemon or t.name.startswith("centralpipe"))
        ]
        remaining_s = deadline - time.monotonic()
        if not leaked or remaining_s <= 0:
            return leaked
        leaked[0].join(timeout=min(remaining_s, _POLL_INTERVAL_S))
