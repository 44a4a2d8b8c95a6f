"""The soak's stage functions, in a module that imports neither torch nor the library.

A worker runs them after unpickling them, which imports their module. The
soak itself imports the whole library and torch (through
:mod:`centralpipe.testing`), so with its functions there each forkserver or
spawn worker, and each replacement of one the soak killed, imported all of it
before its first item: a restart cost seconds, and a 20-second soak ran one
epoch. Here a worker imports only this.
"""

from __future__ import annotations

import os
import signal

__all__ = ["RAISE_AT", "RAISE_MOD", "chaos", "keep", "same", "size", "unbatch"]

#: Items whose chaos stage raises (deterministically): skipped, not lost.
RAISE_MOD, RAISE_AT = 97, 13


def unbatch(batch: list[int]) -> list[int]:
    return batch


def chaos(x: int, *, main_pid: int, marker_dir: str, kill_mod: int) -> int:
    """Raise on some items always; kill the worker on others, once each (a
    marker file in ``marker_dir`` per kill, so the soak can count them)."""
    if x % RAISE_MOD == RAISE_AT:
        raise RuntimeError(f"soak: planned failure on {x}")
    if os.getpid() != main_pid and kill_mod and x % kill_mod == 0:
        marker = os.path.join(marker_dir, str(x))
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return x
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def same(x: int) -> int:
    return x


def keep(x: int) -> bool:
    return x % 11 != 5


def size(x: int) -> int:
    return x % 5 + 1
