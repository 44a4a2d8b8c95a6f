"""The one object the Loader talks to: its central part, wherever it runs.

:class:`Central` is the surface: :meth:`~Central.start` a pass (the pending
resume or the next epoch) and iterate its outputs (``next``), the
checkpoint (:meth:`~Central.state`, :meth:`~Central.load`), reads
(:meth:`~Central.query`, :meth:`~Central.metrics`, :meth:`~Central.total`,
:meth:`~Central.length`, :meth:`~Central.worker_states`,
:meth:`~Central.worker_pids`), :meth:`~Central.stop` (end the current
pass) and :meth:`~Central.close`. :func:`open_central` picks the
implementation from ``LoaderConfig.central``:

- ``"process"``: :class:`~centralpipe.dispatch.local.LocalCentral`, the
  central stages, the dispatch and the worker pool in the caller's process;
- ``"service"``: :class:`~centralpipe.dispatch.client.ServiceClient`, a thin
  client of a ``LocalCentral`` run in one helper process for this Loader;
- ``"node"``: :class:`~centralpipe.dispatch.nodeservice.NodeClient`, the same thin
  client of one service per node shared by the node's local ranks.

The Loader does not know which it has: every method behaves the same, and
``state()`` has the same per-rank format in every mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from centralpipe.config import LoaderConfig
from centralpipe.dispatch.client import ServiceClient
from centralpipe.dispatch.local import LocalCentral
from centralpipe.dispatch.nodeservice import NodeClient
from centralpipe.plan.pipeline import Pipeline
from centralpipe.stages.totals import Total

__all__ = ["Central", "open_central"]


class Central(Protocol):
    """What the Loader needs of its central part (see the module docstring)."""

    @property
    def epoch(self) -> int: ...

    def start(self) -> Iterator[Any]: ...

    def stop(self) -> None: ...

    def set_next_epoch(self, epoch: int) -> None: ...

    def state(self, what: str = ...) -> dict[str, Any]: ...

    def load(self, state_dict: dict[str, Any]) -> None: ...

    def query(self, name: str, *, delivered: bool = False) -> dict[str, Any]: ...

    def metrics(self) -> dict[str, Any]: ...

    def total(self, stage: str | None = None, *, weight: bool = False) -> Total | None: ...

    def length(self) -> int: ...

    def worker_states(self) -> list[dict[str, Any]]: ...

    def worker_pids(self) -> list[int]: ...

    def close(self) -> None: ...


def open_central(pipeline: Pipeline, config: LoaderConfig) -> Central:
    """The central part ``config.central`` asks for, started as far as it
    starts before the first pass (workers in the background, the service)."""
    if config.central == "service":
        return ServiceClient(pipeline, config)
    if config.central == "node":
        return NodeClient(pipeline, config)
    return LocalCentral(pipeline, config)
