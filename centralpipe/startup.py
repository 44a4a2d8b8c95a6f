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
import pickle
import pickletools
import sys
from collections.abc import Sequence
from typing import Any

from centralpipe.errors import PipelineError

__all__ = ["check_picklable", "main_is_importable", "referenced_modules", "references_main"]

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


def referenced_modules(pickled: bytes) -> set[str]:
    """The modules whose names ``pickled`` refers to by reference (functions,
    classes, ``functools.partial`` of one …): what unpickling it imports."""
    found: set[str] = set()
    pushed: list[object] = []  # strings pushed, and memo fetches, in order
    memo: dict[int, object] = {}
    for op, arg, _pos in pickletools.genops(pickled):
        name = op.name
        if name == "GLOBAL" and isinstance(arg, str):
            found.add(arg.split(" ", 1)[0])
        elif name == "STACK_GLOBAL" and len(pushed) >= 2 and isinstance(pushed[-2], str):
            found.add(pushed[-2])
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
    return found


def references_main(pickled: bytes) -> bool:
    """Whether ``pickled`` refers to anything by reference in ``__main__``
    (a function, a class, a ``functools.partial`` of one …)."""
    return MAIN in referenced_modules(pickled)


def check_picklable(specs: Sequence[Any], method: str) -> None:
    """Raise ``PipelineError`` naming the first stage of ``specs`` (worker
    stages, parallel central stages) whose function workers started with
    ``method`` cannot load."""
    if method == "fork":
        return
    main_ok = main_is_importable()
    for spec in specs:
        try:
            pickled = pickle.dumps(spec.fn)
            if not main_ok and references_main(pickled):
                msg = (
                    f"stage '{spec.name}': its function {spec.fn!r} is defined in __main__ "
                    "of an interactive session, a notebook or `python -c`, which worker "
                    f"processes started with '{method}' cannot import. Use "
                    "WorkerConfig(start_method='fork'), or define the function in a module "
                    "(or a script file run as `python script.py`)."
                )
                raise PipelineError(msg)
        except PipelineError:
            raise
        except Exception as exc:
            msg = (
                f"stage '{spec.name}': its function {spec.fn!r} cannot be pickled, which "
                f"start method '{method}' needs to send it to the workers ({exc}). Define it "
                "at module level (not a lambda or a local function), or use "
                "WorkerConfig(start_method='fork')."
            )
            raise PipelineError(msg) from None
