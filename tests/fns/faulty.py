"""Worker-stage functions that misbehave on purpose, for the fault tests.

They live in their own module so that every start method can import them. The
"once" variants use a marker file: the first worker to reach the item creates
it and misbehaves; a replacement worker finds it and behaves.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any


def _first_time(marker: str) -> bool:
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def identity(x: int) -> int:
    return x


def with_pid(x: int) -> tuple[int, int]:
    """The item and the id of the process that ran the stage."""
    return x, os.getpid()


def slow_identity(x: int) -> int:
    time.sleep(0.002)
    return x


def kill_once(x: int, *, at: int, marker: str) -> int:
    """SIGKILL this worker the first time item ``at`` arrives."""
    if x == at and _first_time(marker):
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def kill_once_each(x: int, *, every: int, marker_dir: str) -> int:
    """SIGKILL this worker the first time each multiple of ``every`` arrives."""
    if x % every == 0 and _first_time(str(Path(marker_dir) / f"m{x}")):
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def segfault_once(x: int, *, at: int, marker: str) -> int:
    if x == at and _first_time(marker):
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return x


def segfault_always(x: int, *, at: int) -> int:
    if x == at:
        ctypes.string_at(0)
    return x


def exit_once(x: int, *, at: int, marker: str, code: int = 3) -> int:
    """``os._exit`` the first time item ``at`` arrives."""
    if x == at and _first_time(marker):
        os._exit(code)
    return x


def exit_always(x: int, *, at: int, code: int = 3) -> int:
    if x == at:
        os._exit(code)
    return x


def hang_once(x: int, *, at: int, marker: str) -> int:
    if x == at and _first_time(marker):
        time.sleep(3600)
    return x


def hang_always(x: int, *, at: int) -> int:
    if x == at:
        time.sleep(3600)
    return x


class BadValue(ValueError):
    pass


def raise_at(x: int, *, at: frozenset[int]) -> int:
    if x in at:
        raise BadValue(f"bad item {x}")
    return x


def unpicklable_at(x: int, *, at: int) -> object:
    if x == at:
        return threading.Lock()
    return x


def central_raise_at(x: int, *, at: int) -> int:
    if x == at:
        raise KeyError(f"central failure at {x}")
    return x


def unpicklable_at_5(x: int) -> object:
    """A central map whose item 5 cannot be sent to a worker."""
    return threading.Lock() if x == 5 else x


def big_input(i: int) -> bytes:
    return bytes(106_000)


def big_output(x: bytes) -> bytes:
    return bytes(4_000_000)


def bump_in_place(d: dict[str, int]) -> dict[str, int]:
    """A worker stage that mutates its item in place (a common map style)."""
    d["x"] += 100
    return d


def tokens_of(i: int) -> list[int]:
    """A token list of ``i % 5 + 1`` ids."""
    return [i * 10 + k for k in range(i % 5 + 1)]


def append_in_place(tokens: list[Any]) -> list[Any]:
    """A worker stage that appends to its token list (or to each list of a
    bucket) in place, and returns it."""
    for seq in tokens if tokens and isinstance(tokens[0], list) else [tokens]:
        seq.append(-1)
    return tokens


def as_dict(i: int) -> dict[str, int]:
    return {"x": i}


def hang_interruptible(x: int, *, at: int, release: str) -> int:
    """Hang on item ``at`` until the file ``release`` exists (a thread that can
    be let go at the end of a test)."""
    if x == at:
        while not os.path.exists(release):
            time.sleep(0.01)
    return x
