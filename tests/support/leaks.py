"""Finding child processes, threads and ``/dev/shm`` entries that a test left behind.

Processes come from ``psutil`` (which scans every process's parent, so it sees
children started by any thread). The multiprocessing forkserver and resource
tracker are long-lived helpers started on first use and kept for the whole
session, so they are never reported as leaks; the processes the forkserver
forks for a test are, since they are workers like any other.

``/dev/shm`` is shared by every process of the machine: an entry that appears
during a test and is gone again within the settle time is someone's short-lived
segment (torch and multiprocessing unlink theirs at once), not a leak; nor is
one that only processes outside this process's tree hold open or mapped (a
concurrent test session's, e.g. another pytest-xdist worker). An entry nobody
holds, or that this tree holds after the test, is a leak.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from collections.abc import Iterable

import psutil

HELPER_MARKERS = ("forkserver", "resource_tracker")
SHM_DIR = "/dev/shm"
_POLL_INTERVAL_S = 0.05
_GONE = (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied)


def _running(proc: psutil.Process) -> bool:
    """True unless ``proc`` is gone or a zombie (exited, not yet reaped)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except _GONE:
        return False


def alive(pid: int) -> bool:
    """True while ``pid`` runs: False once it is gone, a zombie or dead."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except _GONE:
        return False


def cmdline(pid: int) -> str:
    """The command line of ``pid`` as one string ('' if gone or a zombie)."""
    try:
        return " ".join(psutil.Process(pid).cmdline()).strip()
    except _GONE:
        return ""


def is_helper(pid: int) -> bool:
    """True for the multiprocessing forkserver and resource tracker processes."""
    line = cmdline(pid)
    return any(marker in line for marker in HELPER_MARKERS)


def child_pids(pid: int | None = None, *, include_zombies: bool = False) -> set[int]:
    """Direct children of ``pid`` (default: this process).

    Zombies (exited, not yet reaped) are left out unless ``include_zombies``.
    """
    try:
        children = psutil.Process(os.getpid() if pid is None else pid).children()
    except _GONE:
        return set()
    return {c.pid for c in children if include_zombies or _running(c)}


def live_descendants(pid: int | None = None) -> set[int]:
    """Running descendants of ``pid`` (default: this process), helpers excluded.

    Helpers are recognised only as direct children of ``pid``: the processes the
    forkserver forks inherit its command line, and those are workers to track.
    """
    root = os.getpid() if pid is None else pid
    try:
        descendants = psutil.Process(root).children(recursive=True)
    except _GONE:
        return set()
    found: set[int] = set()
    for proc in descendants:
        if not _running(proc):
            continue
        with contextlib.suppress(*_GONE):
            if proc.ppid() == root and is_helper(proc.pid):
                continue
        found.add(proc.pid)
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
        with contextlib.suppress(*_GONE):
            psutil.Process(pid).kill()
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


def shm_entries() -> set[str]:
    """Names in ``/dev/shm`` (empty where it does not exist)."""
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


def _holders(names: set[str]) -> dict[str, set[int]]:
    """For each of ``names`` in ``/dev/shm``, the pids that hold it open or mapped."""
    paths = {os.path.join(SHM_DIR, name): name for name in names}
    held: dict[str, set[int]] = {name: set() for name in names}
    for pid in psutil.pids():
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    name = paths.get(os.readlink(f"/proc/{pid}/fd/{fd}"))
                    if name is not None:
                        held[name].add(pid)
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                name = paths.get(line.rstrip("\n").split(maxsplit=5)[-1].removesuffix(" (deleted)"))
                if name is not None:
                    held[name].add(pid)
    return held


def foreign(names: set[str]) -> set[str]:
    """The entries of ``names`` held only by processes outside this process's tree."""
    ours = live_descendants() | {os.getpid()}
    return {name for name, pids in _holders(names).items() if pids and not pids & ours}


def wait_for_new_shm(before: set[str], timeout_s: float) -> set[str]:
    """Wait up to ``timeout_s`` for ``/dev/shm`` entries not in ``before`` to go.

    Returns the ones still there after the wait that are not another process
    tree's (empty when none leaked)."""
    deadline = time.monotonic() + timeout_s
    while True:
        leaked = shm_entries() - before
        if not leaked:
            return leaked
        if time.monotonic() >= deadline:
            return leaked - foreign(leaked)
        time.sleep(_POLL_INTERVAL_S)
