"""Module paths that moved, kept importable.

The package was laid out by role (``plan/``, ``checkpoint/``, ``dispatch/``'s
``executors/``, ``wire/`` and ``worker/``, ``integrations/``, ``testing/``,
``tools/``). Each path in :data:`MOVED` is the module's old path: importing it
gives the module at its new path (the same module object) and emits a
``DeprecationWarning`` naming that path. A path in :data:`PUBLIC` is the
documented one and stays so: it gives the module at its home without a warning.

No file is left at an old path: :class:`MovedFinder` (on ``sys.meta_path``
once ``centralpipe`` is imported) answers for them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Sequence

__all__ = ["MOVED", "PUBLIC", "MovedFinder", "install"]

#: Old path -> new path, deprecated.
MOVED: dict[str, str] = {
    "centralpipe.dispatch.protocol": "centralpipe.dispatch.wire.protocol",
    "centralpipe.dispatch.transport": "centralpipe.dispatch.wire.transport",
    "centralpipe.dispatch.plain": "centralpipe.dispatch.wire.plain",
    "centralpipe.dispatch.shm": "centralpipe.dispatch.wire.ringreader",
    "centralpipe.dispatch.stash": "centralpipe.dispatch.wire.ringwriter",
    "centralpipe.dispatch.chain": "centralpipe.dispatch.worker.chain",
    "centralpipe.dispatch.pool": "centralpipe.dispatch.executors.pool",
    "centralpipe.dispatch.procpool": "centralpipe.dispatch.executors.procpool",
    "centralpipe.dispatch.threadpool": "centralpipe.dispatch.executors.threadpool",
    "centralpipe.dispatch.starter": "centralpipe.dispatch.executors.starter",
    "centralpipe.dispatch.preload": "centralpipe.dispatch.executors.preload",
    "centralpipe.pipeline": "centralpipe.plan.pipeline",
    "centralpipe.specs": "centralpipe.plan.specs",
    "centralpipe.checkpoint_fit": "centralpipe.checkpoint.fit",
    "centralpipe.elastic": "centralpipe.checkpoint.elastic",
    "centralpipe.distributed": "centralpipe.checkpoint.gather",
    "centralpipe.faults": "centralpipe.testing.faults",
    "centralpipe.bench": "centralpipe.tools.bench",
    "centralpipe.bench_contenders": "centralpipe.tools.bench_contenders",
    "centralpipe.bench_limit": "centralpipe.tools.bench_limit",
    "centralpipe.bench_report": "centralpipe.tools.bench_report",
    "centralpipe.bench_seed": "centralpipe.tools.bench_seed",
    "centralpipe.bench_spin": "centralpipe.tools.bench_spin",
    "centralpipe.bench_stages": "centralpipe.tools.bench_stages",
    "centralpipe.bench_state": "centralpipe.tools.bench_state",
    "centralpipe.bench_transport": "centralpipe.tools.bench_transport",
    "centralpipe.bench_workloads": "centralpipe.tools.bench_workloads",
    "centralpipe.soak": "centralpipe.tools.soak",
    "centralpipe.resume": "centralpipe.checkpoint.resume",
    "centralpipe.dispatch.boundary": "centralpipe.dispatch.run",
    "centralpipe.dispatch.guard": "centralpipe.dispatch.chainlock",
    "centralpipe.dispatch.wire.shm": "centralpipe.dispatch.wire.ringreader",
    "centralpipe.dispatch.wire.stash": "centralpipe.dispatch.wire.ringwriter",
}

#: Documented path -> the module's home; not deprecated.
PUBLIC: dict[str, str] = {
    "centralpipe.lightning": "centralpipe.integrations.lightning",
}


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the paths of :data:`MOVED` and :data:`PUBLIC`, loading the module
    from its new path."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED and fullname not in PUBLIC:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED.get(spec.name)
        if new is not None:
            warnings.warn(
                f"{spec.name} has moved to {new}: import {new} instead",
                DeprecationWarning,
                stacklevel=2,
            )
        module = importlib.import_module(new or PUBLIC[spec.name])
        # The import system sets the alias's spec on the module it returns; the
        # module keeps its own (exec_module puts it back).
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        spec = module.__spec__
        if spec is not None and spec.name in self._specs:
            module.__spec__ = self._specs.pop(spec.name)


def install() -> None:
    """Put one :class:`MovedFinder` on ``sys.meta_path`` (after the standard
    finders, which find no file at an old path); idempotent."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
