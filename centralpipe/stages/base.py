"""The base of every central stage: a ``torchdata.nodes.BaseNode`` with a name.

A central stage owns a ``source`` node. Its state, as torchdata expects, is its
own fields plus ``{SOURCE_KEY: source.state_dict()}``; ``own_state()`` is the
part without the source, which the Loader stores per stage name and which
``query()`` reads. Subclasses write ``produce()`` (the next item, or
``StopIteration``), ``own_state()`` and ``restore(state | None)``.
"""

from __future__ import annotations

import abc
import time
from typing import Any, Generic, TypeVar

import attrs
from torchdata.nodes import BaseNode

__all__ = ["SOURCE_KEY", "CentralNode", "RunContext", "add_stage_note"]

SOURCE_KEY = "source"
#: Stage time is measured on one call in this many.
TIME_EVERY = 16
T = TypeVar("T")


@attrs.define
class RunContext:
    """What central stages read at ``reset()``: seed, epoch and rank."""

    seed: int = 0
    epoch: int = 0
    rank: int = 0
    world_size: int = 1


def add_stage_note(exc: BaseException, stage: str) -> None:
    """Name the central stage an exception came from (once, innermost wins)."""
    if getattr(exc, "_centralpipe_stage", None) is None:
        try:
            exc._centralpipe_stage = stage  # type: ignore[attr-defined]
        except AttributeError:  # pragma: no cover - exceptions with __slots__
            return
        exc.add_note(f"(raised in central stage '{stage}')")


class CentralNode(BaseNode[T], Generic[T]):
    """A named central stage; see the module docstring."""

    kind: str = "node"

    def __init__(self, source: BaseNode[Any] | None, *, name: str, ctx: RunContext) -> None:
        super().__init__()
        self.source = source
        self.name = name
        self.ctx = ctx
        self.items_out = 0
        self.time_s = 0.0

    # -- torchdata.nodes protocol ---------------------------------------------

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if self.source is not None:
            self.source.reset(None if initial_state is None else initial_state[SOURCE_KEY])
        self.restore(initial_state)

    def get_state(self) -> dict[str, Any]:
        state = self.own_state()
        if self.source is not None:
            state[SOURCE_KEY] = self.source.state_dict()
        return state

    def next(self) -> T:
        # Time one call in TIME_EVERY (and count it TIME_EVERY times): the
        # clock costs as much as a cheap stage, and the estimate is unbiased.
        n = self.items_out
        timed = not n % TIME_EVERY
        start = time.perf_counter() if timed else 0.0
        try:
            item = self.produce()
        except StopIteration:
            raise
        except Exception as exc:
            add_stage_note(exc, self.name)
            raise
        finally:
            if timed:
                self.time_s += (time.perf_counter() - start) * TIME_EVERY
        self.items_out = n + 1
        return item

    # -- flat state, keyed by stage name (what the Loader checkpoints) --------

    def chain(self) -> list[CentralNode[Any]]:
        """The central nodes from the source up to this one."""
        below = self.source.chain() if isinstance(self.source, CentralNode) else []
        return [*below, self]

    def load_flat(self, flat: dict[str, Any] | None) -> None:
        """Reset the chain up to here: each stage from ``flat[name]`` (or to the
        start of an epoch when ``flat`` is ``None``)."""
        if isinstance(self.source, CentralNode):
            self.source.load_flat(flat)
        elif self.source is not None:
            self.source.reset(None)
        BaseNode.reset(self, None)
        self.restore(None if flat is None else flat[self.name])

    # -- for subclasses ------------------------------------------------------

    @abc.abstractmethod
    def produce(self) -> T:
        """The next item, or ``StopIteration`` at the end of the epoch."""

    def own_state(self) -> dict[str, Any]:
        """This stage's state without its source's (a fresh dict)."""
        return {}

    def restore(self, state: dict[str, Any] | None) -> None:
        """Start of an epoch (``None``) or the position in ``state``."""

    def query_state(self) -> dict[str, Any]:
        """What ``Loader.query(name)`` returns: ``own_state()`` unless a stage
        holds a large buffer, in which case a summary."""
        return self.own_state()

    def release(self) -> None:
        """Close what the stage holds open (files); the next ``reset`` reopens."""
        if isinstance(self.source, CentralNode):
            self.source.release()

    def source_time_s(self) -> float:
        return self.source.time_s if isinstance(self.source, CentralNode) else 0.0

    def source_items(self) -> int | None:
        return self.source.items_out if isinstance(self.source, CentralNode) else None
