"""``count``: passes items through and keeps queryable totals.

State ``{"items": n, "weight": w}``; ``weight`` sums ``weight_fn(item)``, or
counts items without one. A weight is a finite number, kept as a Python
``int`` or ``float`` (numpy scalars and one-element tensors are converted, so
no two totals share a tensor); anything else is a ``PipelineError`` naming the
stage (:mod:`centralpipe.stages.measures`). Placed before ``shard()``, it counts the whole
central stream on every rank — the pre-shard progress a progress bar shows.
An interrupt inside ``weight_fn`` leaves the item held (uncounted) for the
next ``next()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from torchdata.nodes import BaseNode

from centralpipe.plan.specs import StageSpec
from centralpipe.stages.base import HELD, CentralNode, RunContext, Total, held_items, pull_one
from centralpipe.stages.measures import as_weight
from centralpipe.validators import NUMBER, FieldError, checked, int_in

__all__ = ["Count", "CountState"]

ITEMS_KEY = "items"
WEIGHT_KEY = "weight"


@attrs.frozen(kw_only=True)
class CountState:
    items: int = attrs.field(validator=checked(FieldError, "an int >= 0", int_in(0, 2**63)))
    weight: float = attrs.field(validator=checked(FieldError, "a number", NUMBER))
    held: list[Any] = attrs.field(factory=list, converter=held_items, validator=HELD)


class Count(CentralNode[Any]):
    kind = "count"
    State = CountState
    stamped = True

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> Count:
        return cls(source, spec.fn, name=spec.name, ctx=ctx)

    def out_total(self, total: Total) -> Total | None:
        return total

    def __init__(
        self,
        source: BaseNode[Any],
        weight_fn: Callable[[Any], float] | None,
        *,
        name: str,
        ctx: RunContext,
    ) -> None:
        super().__init__(source, name=name, ctx=ctx)
        self._weight_fn = weight_fn
        #: ``(items, weight)``: the one home of the totals, replaced (one
        #: attribute store) on each change, so a reader without the chain
        #: lock never sees items of one moment and weight of another.
        self.snapshot: tuple[int, float] = (0, 0)

    @property
    def items(self) -> int:
        return self.snapshot[0]

    @property
    def weight(self) -> float:
        return self.snapshot[1]

    def produce(self) -> Any:
        assert self.source is not None
        held = self.held
        if not held:
            pull_one(self.source, held)
        item = held[-1]
        del held[-1]
        items, weight = self.snapshot
        if self._weight_fn is None:
            self.snapshot = (items + 1, weight + 1)
            return item
        try:
            w = self._weight_fn(item)
            # Fast path: an int, or a finite float (inf - inf and nan - nan are nan).
            if type(w) is not int and not (type(w) is float and w - w == 0.0):
                w = as_weight(w, self.name, items)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # interrupted: counted by the next call
                held.append(item)
            raise
        self.snapshot = (items + 1, weight + w)
        return item

    def max_items_out(self, state: CountState, bound_in: int | None) -> int | None:
        return state.items

    def totals(self) -> tuple[int, float]:
        return self.snapshot

    def own_state(self) -> dict[str, Any]:
        items, weight = self.snapshot
        return self.with_held({ITEMS_KEY: items, WEIGHT_KEY: weight})

    def query_state(self) -> dict[str, Any]:
        items, weight = self.snapshot
        return {ITEMS_KEY: items, WEIGHT_KEY: weight}

    def live_view(self) -> dict[str, Any]:
        # One read of the tuple the chain last published (see ``snapshot``).
        items, weight = self.snapshot
        return {ITEMS_KEY: items, WEIGHT_KEY: weight}

    def restore(self, state: dict[str, Any] | None) -> None:
        if state is None:
            self.snapshot = (0, 0)
        else:
            self.snapshot = (int(state[ITEMS_KEY]), state[WEIGHT_KEY])
        self.restore_held(state)

    def check_state(self, state: CountState, states: Any) -> None:
        self.check_held(state.held, 1)
