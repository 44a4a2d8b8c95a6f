"""Checks made before any worker starts, so a doomed start fails at once, clearly.

A function that pickles fine may still be impossible to load in a worker: with
the ``forkserver`` and ``spawn`` start methods the worker imports every
function by ``module.name``, and a function defined in ``__main__`` of an
interactive session, a notebook or ``python -c`` has no module a new process
could import (a script run as ``python train.py`` or ``python -m pkg.train``
does). Without this check every worker dies at start-up and the error blames
a missing ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import os
import pickletools
import sys

__all__ = ["main_is_importable", "references_main"]

MAIN = "__main__"


def main_is_importable() -> bool:
    """Whether a new process can import this process's ``__main__`` (a script
    file, or a module run with ``-m``)."""
    main = sys.modules.get(MAIN)
    if main is None:
        return False
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", None):
        return True
    path = getattr(main, "__file__", None)
    return isinstance(path, str) and os.path.isfile(path)


def references_main(pickled: bytes) -> bool:
    """Whether ``pickled`` refers to anything by reference in ``__main__``
    (a function, a class, a ``functools.partial`` of one …)."""
    pushed: list[object] = []  # strings pushed, and memo fetches, in order
    memo: dict[int, object] = {}
    for op, arg, _pos in pickletools.genops(pickled):
        name = op.name
        if name == "GLOBAL" and isinstance(arg, str) and arg.split(" ", 1)[0] == MAIN:
            return True
        if name == "STACK_GLOBAL" and len(pushed) >= 2 and pushed[-2] == MAIN:
            return True
        if name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif name in ("PUT", "BINPUT", "LONG_BINPUT") and isinstance(arg, int):
            memo[arg] = pushed[-1] if pushed else None
        elif name in ("GET", "BINGET", "LONG_BINGET") and isinstance(arg, int):
            pushed.append(memo.get(arg))
        elif isinstance(arg, str) and "UNICODE" in name:
            pushed.append(arg)
        else:
            pushed.append(None)
    return False
