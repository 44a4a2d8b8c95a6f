"""``shard``: keep central index ``i`` when ``i % world_size == rank``.

Every rank runs the same central stream, so equalising needs no
communication: ``"drop_last"`` emits a rank's item only once its whole round
of ``world_size`` items exists (the last incomplete round is dropped on every
rank); ``"pad"`` completes that last round by reusing its items cyclically, so
nothing is dropped. ``index`` — the central (pre-shard) index of the next item —
is recorded in every checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from attrs import validators as v
from torchdata.nodes import BaseNode

from centralpipe.pipeline import StageSpec
from centralpipe.stages.base import CentralNode, RunContext, Total
from centralpipe.validators import FieldError, checked, int_in, sequence_of

__all__ = ["Shard", "ShardState", "shard_length"]

INDEX_KEY = "index"
ROUND_KEY = "round"
DONE_KEY = "done"


@attrs.frozen(kw_only=True)
class ShardState:
    index: int = attrs.field(validator=checked(FieldError, "an int >= 0", int_in(0, 2**63)))
    round: list[Any] = attrs.field(validator=checked(FieldError, "a list", sequence_of()))
    done: bool = attrs.field(validator=checked(FieldError, "a bool", v.instance_of(bool)))


class Shard(CentralNode[Any]):
    kind = "shard"
    State = ShardState
    stamped = True

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> Shard:
        return cls(source, spec.options["equalize"], name=spec.name, ctx=ctx)

    def out_total(self, total: Total) -> Total | None:
        n = shard_length(total.items, self._equalize, self.ctx.rank, self.ctx.world_size)
        return attrs.evolve(total, items=n)

    def __init__(
        self, source: BaseNode[Any], equalize: str | None, *, name: str, ctx: RunContext
    ) -> None:
        super().__init__(source, name=name, ctx=ctx)
        self._equalize = equalize
        self.index = 0
        self._round: list[Any] = []
        self._done = False

    def produce(self) -> Any:
        assert self.source is not None
        ws, rank, source = self.ctx.world_size, self.ctx.rank, self.source
        if self._equalize is None:
            while True:
                item = next(source)
                i = self.index
                self.index = i + 1
                if i % ws == rank:
                    return item
        if self._done:
            raise StopIteration
        rnd = self._round
        while True:
            try:
                item = next(source)
            except StopIteration:
                self._done = True
                if self._equalize == "pad" and rnd:
                    out = rnd[rank % len(rnd)]
                    self._round = []
                    return out
                self._round = []
                raise
            self.index += 1
            rnd.append(item)
            if len(rnd) == ws:
                out = rnd[rank]
                rnd.clear()
                return out

    def own_state(self) -> dict[str, Any]:
        return {INDEX_KEY: self.index, ROUND_KEY: list(self._round), DONE_KEY: self._done}

    def restore(self, state: dict[str, Any] | None) -> None:
        self.index = 0 if state is None else state[INDEX_KEY]
        self._round = [] if state is None else list(state[ROUND_KEY])
        self._done = False if state is None else state[DONE_KEY]

    def max_items_out(self, state: ShardState, bound_in: int | None) -> int | None:
        # Each output consumed an input, except the one "pad" may add at the end.
        return state.index + (self._equalize == "pad")

    def check_state(self, state: ShardState, states: Mapping[str, Any]) -> None:
        # The round holds the items of the current round of world_size so far.
        if self._equalize is None or state.done:
            if state.round:
                raise FieldError("round", "[] (no round is being filled)", state.round)
            if state.done and self._equalize is None:
                raise FieldError("done", "False (equalize is None)", state.done)
            return
        n = state.index % self.ctx.world_size
        if len(state.round) != n:
            expected = f"{n} items (index {state.index} mod world_size {self.ctx.world_size})"
            raise FieldError("round", expected, state.round)


def shard_length(n: int, equalize: str | None, rank: int, world_size: int) -> int:
    """Items a rank gets from ``n`` central items."""
    if equalize == "drop_last":
        return n // world_size
    if equalize == "pad":
        return -(-n // world_size)
    return max(0, -(-(n - rank) // world_size))
