"""Two tests the leak fixture judges, run by ``test_shm.py`` in a pytest of
their own (the file name keeps them out of the suite): one leaves an entry
in ``/dev/shm``, one removes it again. ``CENTRALPIPE_LEAK_PROBE`` names it."""

from __future__ import annotations

import os

from tests.support.leaks import SHM_DIR


def _path() -> str:
    return os.path.join(SHM_DIR, os.environ["CENTRALPIPE_LEAK_PROBE"])


#: The leaked entry stays open in this process until it exits, as a leaking
#: program holds its segment: a concurrent session's leak check sees an entry
#: of another process tree, not one of its own.
_HELD = []


def test_leaves_an_entry_in_dev_shm() -> None:
    """Creates the entry and leaves it: the fixture must fail this test."""
    f = open(_path(), "wb")  # noqa: SIM115 - held open on purpose, see _HELD
    f.write(b"x")
    f.flush()
    _HELD.append(f)


def test_removes_its_entry_again() -> None:
    """Creates the entry and removes it: the fixture must let this pass."""
    with open(_path() + "-gone", "wb") as f:
        f.write(b"x")
    os.unlink(_path() + "-gone")
