"""Fixtures shared by every test: leak checks, a small text corpus, and
chunks that do not depend on timing (``whole_chunks``)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from centralpipe.dispatch import timeouts
from tests.support.leaks import (
    describe,
    kill_processes,
    live_descendants,
    shm_entries,
    wait_for_new_processes,
    wait_for_new_shm,
    wait_for_new_threads,
)

LEAK_WAIT_S = 5.0
#: How long a new /dev/shm entry may stay after a test before it is a leak.
SHM_SETTLE_S = 1.0

# File name -> exact bytes. Names sort in this order.
CORPUS: dict[str, bytes] = {
    "a_empty.txt": b"",
    "b_no_trailing_newline.txt": b"alpha\nbeta\ngamma",
    "c_unicode_crlf.txt": "naïve café\r\nЖёлтый 日本語 🙂\r\n\r\nlast line\r\n".encode(),
}


@pytest.fixture(autouse=True, scope="session")
def ctrl_c_raises() -> Iterator[None]:
    """Ctrl-C raises ``KeyboardInterrupt`` in the tests, however pytest was
    started: a shell starts a background job (``make test &``) with SIGINT
    ignored, Python then installs no handler, and the tests that send real
    SIGINTs (and their subprocesses, which inherit the ignore) would see none
    land. Installing the handler also gives subprocesses the default again."""
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    """Fail a test that leaves child processes or non-daemon threads running,
    or anything in ``/dev/shm``.

    Processes and threads get ``LEAK_WAIT_S`` to finish after the test; leaked
    processes are then killed so the failure does not spill into later tests.
    """
    processes_before = live_descendants()
    threads_before = set(threading.enumerate())
    shm_before = shm_entries()
    yield
    problems = []
    leaked = wait_for_new_processes(processes_before, LEAK_WAIT_S)
    if leaked:
        problems.append(
            f"{len(leaked)} child process(es) still running {LEAK_WAIT_S:g} s after the "
            f"test (now killed):\n{describe(leaked)}"
        )
        kill_processes(leaked)
    threads = wait_for_new_threads(threads_before, LEAK_WAIT_S)
    if threads:
        names = ", ".join(repr(t.name) for t in threads)
        problems.append(
            f"{len(threads)} non-daemon thread(s) still alive {LEAK_WAIT_S:g} s after the "
            f"test: {names}"
        )
    shm = wait_for_new_shm(shm_before, SHM_SETTLE_S)
    if shm:
        problems.append(f"{len(shm)} new entry(ies) in /dev/shm after the test: {sorted(shm)}")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.fixture
def tmp_corpus(tmp_path: Path) -> list[str]:
    """Three small text files: empty, no trailing newline, non-ASCII with CRLF.

    Returns their paths as strings, sorted. Contents are in ``CORPUS``.
    """
    paths = []
    for name, data in CORPUS.items():
        path = tmp_path / name
        path.write_bytes(data)
        paths.append(str(path))
    return sorted(paths)


@pytest.fixture
def whole_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks sent only when full (or the source ended), never after
    ``timeouts.FLUSH_S``: for tests that assert what a chunk holds or what is
    in flight. The flush sends a partly filled chunk when the central chain
    is slow, so on a loaded machine chunk boundaries would depend on timing.

    The bound is read at the moment of the wait, in the process that pulls
    (this one; forked workers inherit it, and they never pull)."""
    monkeypatch.setattr(timeouts, "FLUSH_S", 3600.0)
