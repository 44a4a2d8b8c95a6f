"""Central ``map``, ``filter`` and ``flat_map``: the node classes of the per-item kinds.

Each kind's rules (typed options, length rule, how it applies in the
workers) are its :class:`~centralpipe.plan.kinds.WorkerKind`, which the node
class looks up. A spec with ``parallel=True`` becomes a
:class:`~centralpipe.stages.parallel.Parallel` (the function runs on the
workers); otherwise the function runs inline, in the central chain.

``map`` and ``filter`` keep no state of their own. ``flat_map`` keeps the
outputs of the current input that were not yet emitted, so a checkpoint in the
middle of one input's outputs resumes exactly without calling ``fn`` again.

An interrupt (any exception that is not an ``Exception``, e.g. Ctrl-C) inside
``fn`` leaves its input held (``{"held": [input]}``): the next ``next()``
calls ``fn`` on it again, and a checkpoint taken meanwhile resumes there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import attrs
from torchdata.nodes import BaseNode

from centralpipe.plan.kinds import FILTER, FLAT_MAP, MAP, WorkerKind
from centralpipe.plan.specs import StageSpec
from centralpipe.stages.base import (
    HELD,
    CentralNode,
    HeldState,
    RunContext,
    Total,
    held_items,
    pull_one,
)
from centralpipe.stages.parallel import Parallel
from centralpipe.validators import FieldError, checked, sequence_of

__all__ = ["Filter", "FlatMap", "FlatMapState", "Map"]

PENDING_KEY = "pending"
#: Inputs an inline ``map`` pulls from its source at once in a bulk pull;
#: at most this many wait in its ``held`` (and in a checkpoint's).
MAP_BULK = 64


@attrs.frozen(kw_only=True)
class FlatMapState:
    pending: list[Any] = attrs.field(validator=checked(FieldError, "a list", sequence_of()))
    held: list[Any] = attrs.field(factory=list, converter=held_items, validator=HELD)


class _PerItem(CentralNode[Any]):
    """The node of a per-item kind (``item_kind``): inline, or parallel."""

    item_kind: ClassVar[WorkerKind]

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> CentralNode[Any]:
        if spec.parallel:
            return Parallel.from_spec(spec, source, ctx)
        return cls(source, spec.fn, name=spec.name, ctx=ctx)

    def __init__(
        self, source: BaseNode[Any], fn: Callable[..., Any], *, name: str, ctx: RunContext
    ) -> None:
        super().__init__(source, name=name, ctx=ctx)
        self._fn = fn

    def out_total(self, total: Total) -> Total | None:
        return self.item_kind.out_total(total, self.name)

    def max_items_out(self, state: Any, bound_in: int | None) -> int | None:
        return self.item_kind.max_items_out(bound_in)


class _OneHeld(_PerItem):
    """A stage that holds at most the one input of an interrupted call."""

    State = HeldState

    def own_state(self) -> dict[str, Any]:
        return self.with_held({})

    def restore(self, state: dict[str, Any] | None) -> None:
        self.restore_held(state)

    def check_state(self, state: Any, states: Any) -> None:
        self.check_held(state.held, self.most_held)

    #: The most inputs a call can leave held.
    most_held = 1


class Map(_OneHeld):
    kind = MAP.name
    item_kind = MAP
    most_held = MAP_BULK

    def produce(self) -> Any:
        assert self.source is not None
        held = self.held
        if not held:
            pull_one(self.source, held)
        item = held[0]
        del held[0]
        try:
            return self._fn(item)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # interrupted: the next call retries it
                held.insert(0, item)
            raise

    def produce_into(self, out: list[Any], n: int) -> None:
        """Up to ``n`` outputs from at most ``MAP_BULK`` inputs pulled at once
        (or held: a loaded state may hold more than ``n``).

        The inputs wait in ``held`` (saved by a checkpoint). Each leaves it
        only once ``fn`` has returned, and its output is appended right
        after with no call in between: an interrupt inside ``fn`` leaves it
        held (``fn`` runs on it again), one after the append finds it gone,
        so nothing is lost or repeated. An input whose ``fn`` raises an
        ``Exception`` is consumed, as in :meth:`produce`; the inputs after it
        stay held for the next call."""
        held, fn = self.held, self._fn
        if not held:
            source = self.source
            try:
                if isinstance(source, CentralNode):
                    source.pull_into(held, min(n, MAP_BULK))
                else:
                    assert source is not None
                    held.append(source.__next__())
            except StopIteration:
                if not held:
                    raise
        for _ in range(min(n, len(held))):
            item = held[0]
            try:
                value = fn(item)
            except Exception:
                del held[0]
                raise
            del held[0]  # a subscript deletion, not a call: no interrupt lands here
            out.append(value)


class Filter(_OneHeld):
    kind = FILTER.name
    item_kind = FILTER

    def produce(self) -> Any:
        assert self.source is not None
        pred, source, held = self._fn, self.source, self.held
        while True:
            if not held:
                pull_one(source, held)
            item = held[-1]
            del held[-1]
            try:
                keep = pred(item)
            except BaseException as exc:
                if not isinstance(exc, Exception):  # interrupted: the next call retries it
                    held.append(item)
                raise
            if keep:
                return item


class FlatMap(_PerItem):
    kind = FLAT_MAP.name
    item_kind = FLAT_MAP
    State = FlatMapState

    def __init__(
        self,
        source: BaseNode[Any],
        fn: Callable[[Any], Iterable[Any]],
        *,
        name: str,
        ctx: RunContext,
    ) -> None:
        super().__init__(source, fn, name=name, ctx=ctx)
        self._pending: deque[Any] = deque()

    def produce(self) -> Any:
        assert self.source is not None
        pending, held = self._pending, self.held
        while not pending:
            if not held:
                pull_one(self.source, held)
            item = held[-1]
            del held[-1]
            outputs: list[Any] = []
            try:
                outputs.extend(self._fn(item))
            except BaseException as exc:
                if isinstance(exc, Exception):  # a failure: the outputs made so far go on
                    pending.extend(outputs)
                else:  # interrupted: the next call runs fn on it again
                    held.append(item)
                raise
            pending.extend(outputs)
        # Not popleft(): a Ctrl-C handled as that call returns would drop the output.
        out = pending[0]
        del pending[0]
        return out

    def own_state(self) -> dict[str, Any]:
        return self.with_held({PENDING_KEY: list(self._pending)})

    def restore(self, state: dict[str, Any] | None) -> None:
        self._pending = deque(() if state is None else state[PENDING_KEY])
        self.restore_held(state)

    def check_state(self, state: FlatMapState, states: Any) -> None:
        self.check_held(state.held, 0 if state.pending else 1)
