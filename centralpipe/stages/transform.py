"""Central ``map``, ``filter`` and ``flat_map``.

``map`` and ``filter`` keep no state of their own. ``flat_map`` keeps the
outputs of the current input that were not yet emitted, so a checkpoint in the
middle of one input's outputs resumes exactly without calling ``fn`` again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import attrs
from torchdata.nodes import BaseNode

from centralpipe.pipeline import StageSpec
from centralpipe.stages.base import CentralNode, NoState, RunContext, Total
from centralpipe.validators import FieldError, checked, sequence_of

__all__ = ["Filter", "FlatMap", "FlatMapState", "Map"]

PENDING_KEY = "pending"


@attrs.frozen(kw_only=True)
class FlatMapState:
    pending: list[Any] = attrs.field(validator=checked(FieldError, "a list", sequence_of()))


class Map(CentralNode[Any]):
    kind = "map"
    State = NoState

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> Map:
        return cls(source, spec.fn, name=spec.name, ctx=ctx)

    def out_total(self, total: Total) -> Total | None:
        return total

    def max_items_out(self, state: Any, bound_in: int | None) -> int | None:
        return bound_in

    def __init__(
        self, source: BaseNode[Any], fn: Callable[[Any], Any], *, name: str, ctx: RunContext
    ) -> None:
        super().__init__(source, name=name, ctx=ctx)
        self._fn = fn

    def produce(self) -> Any:
        assert self.source is not None
        return self._fn(next(self.source))


class Filter(CentralNode[Any]):
    kind = "filter"
    State = NoState

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> Filter:
        return cls(source, spec.fn, name=spec.name, ctx=ctx)

    def out_total(self, total: Total) -> Total | None:
        return total.at_most(self.name)

    def max_items_out(self, state: Any, bound_in: int | None) -> int | None:
        return bound_in

    def __init__(
        self, source: BaseNode[Any], pred: Callable[[Any], bool], *, name: str, ctx: RunContext
    ) -> None:
        super().__init__(source, name=name, ctx=ctx)
        self._pred = pred

    def produce(self) -> Any:
        assert self.source is not None
        pred, source = self._pred, self.source
        while True:
            item = next(source)
            if pred(item):
                return item


class FlatMap(CentralNode[Any]):
    kind = "flat_map"
    State = FlatMapState

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> FlatMap:
        return cls(source, spec.fn, name=spec.name, ctx=ctx)

    def __init__(
        self,
        source: BaseNode[Any],
        fn: Callable[[Any], Iterable[Any]],
        *,
        name: str,
        ctx: RunContext,
    ) -> None:
        super().__init__(source, name=name, ctx=ctx)
        self._fn = fn
        self._pending: deque[Any] = deque()

    def produce(self) -> Any:
        assert self.source is not None
        while not self._pending:
            self._pending.extend(self._fn(next(self.source)))
        return self._pending.popleft()

    def own_state(self) -> dict[str, Any]:
        return {PENDING_KEY: list(self._pending)}

    def restore(self, state: dict[str, Any] | None) -> None:
        self._pending = deque(() if state is None else state[PENDING_KEY])
