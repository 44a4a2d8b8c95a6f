"""What the forkserver imports before it forks a worker: only what workers need.

The worker loop (:mod:`centralpipe.dispatch.worker.loop`) imports neither torch
nor the builder nor the central stages, so a server that preloads only it is
ready in about a tenth of a second, and so are the workers it forks. torch
costs about a second of CPU to import (more on a loaded machine): the server
preloads it too when the workers will need it, so that they share one import
(forked from it) instead of each paying its own.

They need it when a worker stage's function comes from torch (e.g. the
default ``collate``), uses a seeded ``torch.Generator`` (``with_rng=True``),
or comes from a module that imports torch. That last point is read in this
process, where those modules are imported already: from the function's module,
through the modules its globals refer to and the packages above each of them
(importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` first),
transitively (the standard library and the ``centralpipe`` package's own
``__init__``, whose names load lazily, are not followed). A function in
``mylib.fns`` whose ``mylib/__init__.py`` imports torch needs torch as much
as one whose own module does. A module that imports torch only inside a function is not
seen; its workers then import torch at the first call, which is correct, only
slower. Items that hold tensors make a worker import torch when it first
receives one, whatever was preloaded.

The forkserver is one per process, started by the first ``Loader`` that uses
it: that Loader's stages decide what it preloads, and later Loaders fork from
the same server (their workers import what the server lacks).
"""

from __future__ import annotations

import pickle
import sys
import types
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from centralpipe.startup import referenced_modules

__all__ = ["TORCH", "WORKER_MODULE", "needs_torch", "server_preload"]

#: The worker loop: what every worker runs, torch-free.
WORKER_MODULE = "centralpipe.dispatch.worker.loop"
TORCH = "torch"
#: Modules looked at before giving up (and preloading only the worker loop).
_MAX_MODULES = 400
#: Not followed: its public names are imported lazily, so importing it in a
#: worker imports nothing else; whatever this process has loaded through it
#: says nothing about a worker.
_LAZY_PACKAGES = frozenset({"centralpipe"})


def server_preload(specs: Sequence[Any]) -> list[str]:
    """The modules a forkserver should import for workers running ``specs``
    (worker stages and parallel central stages)."""
    return [WORKER_MODULE, TORCH] if needs_torch(specs) else [WORKER_MODULE]


def needs_torch(specs: Sequence[Any]) -> bool:
    """Whether workers running ``specs`` will import torch (see the module
    docstring for how it is read, and what is missed)."""
    roots: set[str] = set()
    for spec in specs:
        if spec.item_options.with_rng:
            return True
        try:
            roots |= referenced_modules(pickle.dumps(spec.fn))
        except Exception:  # unpicklable: the start-up checks report it
            continue
    return _reaches_torch(roots)


def _top(name: str) -> str:
    return name.partition(".")[0]


def _reaches_torch(roots: Iterable[str]) -> bool:
    seen: set[str] = set()
    queue = deque(roots)
    while queue and len(seen) < _MAX_MODULES:
        name = queue.popleft()
        if name in seen:
            continue
        seen.add(name)
        top = _top(name)
        if top == TORCH:
            return True
        if top in sys.stdlib_module_names or name in _LAZY_PACKAGES:
            continue
        module = sys.modules.get(name)
        if module is None:
            continue
        queue.extend(ref for ref in (*_parents(name), *_references(module)) if ref not in seen)
    return False


def _parents(name: str) -> list[str]:
    """The packages importing ``name`` imports first: ``a``, ``a.b`` for ``a.b.c``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _references(module: types.ModuleType) -> list[str]:
    """Names of the modules ``module``'s globals come from.

    A package's own submodules are left out: the import system sets each one
    as an attribute of the package once anything imports it, so they say what
    this process imported, not what importing the package imports."""
    out: list[str] = []
    try:
        values = list(vars(module).values())
    except TypeError:  # pragma: no cover - a module without a __dict__
        return out
    inside = module.__name__ + "."
    for value in values:
        if isinstance(value, types.ModuleType):
            ref = value.__name__
            if ref.startswith(inside):
                continue
        elif isinstance(value, type | types.FunctionType | types.BuiltinFunctionType):
            ref = value.__module__
        else:
            # An instance (a transform object, a tokenizer): its class's module.
            ref = type(value).__module__
        if isinstance(ref, str):
            out.append(ref)
    return out
