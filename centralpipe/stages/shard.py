"""``shard``: keep stream position ``p`` when ``(p - base) % world_size == rank``.

Every rank runs the same central stream, so equalising needs no
communication: ``"drop_last"`` emits a rank's item only once its whole round
of ``world_size`` items exists (the last incomplete round is dropped on every
rank, and kept in the state's ``round``, so that a merge for another world
size can decide again); ``"pad"`` completes that last round by reusing its
items cyclically, so nothing is dropped. ``index`` — the stream position of
the next item — is recorded in every checkpoint.

Elastic resume (:mod:`centralpipe.checkpoint.elastic`) needs three more things, all empty
in a run that started at the beginning of an epoch:

- ``base``: the position where this world size's sharding started (rounds and
  ranks count from it); 0 at the start of an epoch.
- ``queue``: central items to consume before the source — the items other
  ranks had pulled but not delivered, merged back into central order.
- ``drop``: source items (numbered by ``source_index``) already delivered by
  some rank before a merge, skipped when the source reaches them.

For the delivered view of ``count`` stages before the shard, the shard
remembers each item's *arrival stamp* (those counts as the item reached the
shard): queued items carry theirs from the checkpoint, items held for a round
keep theirs in ``round_stamps``, and :meth:`stamp` gives the emitted item's.

Interrupts: between taking an item from the source and keeping it (in the
round, or by returning it) the shard calls no Python function (the live
counts' ``snapshot`` tuples are read by ``operator.attrgetter``), so an
interrupt (Ctrl-C) in a nested ``next()`` or at any call of its own finds the
state whole.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Mapping
from typing import Any

import attrs
from attrs import validators as v
from torchdata.nodes import BaseNode

from centralpipe.checkpoint import compact
from centralpipe.plan.options import ShardOptions
from centralpipe.plan.specs import StageSpec
from centralpipe.stages.base import CentralNode, RunContext, Total
from centralpipe.stages.count import Count
from centralpipe.validators import FieldError, checked, int_in, sequence_of

__all__ = ["ANY_EQUALIZE", "Shard", "ShardState", "check_shard_state", "shard_length"]

INDEX_KEY = "index"
ROUND_KEY = "round"
DONE_KEY = "done"
BASE_KEY = "base"
QUEUE_KEY = "queue"
QUEUE_STAMPS_KEY = "queue_stamps"
ROUND_STAMPS_KEY = "round_stamps"
SOURCE_INDEX_KEY = "source_index"
DROP_KEY = "drop"

Stamp = tuple[tuple[int, float], ...]
#: A count's totals, read in C: no function call, so no point for an interrupt
#: (its ``snapshot``, one attribute: a property would be a Python call).
_TOTALS = operator.attrgetter("snapshot")

_INDEX = checked(FieldError, "an int >= 0", int_in(0, 2**63))
_LIST = checked(FieldError, "a list", sequence_of())


def _is_stamp(_inst: Any, _attr: Any, value: Any) -> None:
    if not isinstance(value, (list, tuple)):
        raise TypeError(value)
    for pair in value:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TypeError(pair)
        int_in(0, 2**63)(_inst, _attr, pair[0])


_STAMPS = checked(
    FieldError, "a list of count stamps ([[items, weight], ...])", sequence_of(_is_stamp)
)


def _decoded_round(value: Any) -> Any:
    return compact.decoded_items(ROUND_KEY, value)


def _decoded_queue(value: Any) -> Any:
    return compact.decoded_items(QUEUE_KEY, value)


@attrs.frozen(kw_only=True)
class ShardState:
    #: ``round`` and ``queue`` are saved compact when their items are arrays
    #: (``checkpoint.compact``), so that ``torch.load(weights_only=True)`` reads them.
    index: int = attrs.field(validator=_INDEX)
    round: list[Any] = attrs.field(converter=_decoded_round, validator=_LIST)
    done: bool = attrs.field(validator=checked(FieldError, "a bool", v.instance_of(bool)))
    base: int = attrs.field(validator=_INDEX)
    queue: list[Any] = attrs.field(converter=_decoded_queue, validator=_LIST)
    queue_stamps: list[Any] = attrs.field(validator=_STAMPS)
    round_stamps: list[Any] = attrs.field(validator=_STAMPS)
    source_index: int = attrs.field(validator=_INDEX)
    drop: list[int] = attrs.field(
        validator=checked(FieldError, "a list of source numbers", sequence_of(int_in(0, 2**63)))
    )

    def __attrs_post_init__(self) -> None:
        if self.base > self.index:
            raise FieldError("base", f"<= index ({self.index})", self.base)
        if self.queue_stamps and len(self.queue_stamps) != len(self.queue):
            raise FieldError(
                "queue_stamps", f"[] or one per queued item ({len(self.queue)})", self.queue_stamps
            )
        if self.round_stamps and len(self.round_stamps) != len(self.round):
            raise FieldError(
                "round_stamps", f"[] or one per round item ({len(self.round)})", self.round_stamps
            )
        if list(self.drop) != sorted(set(self.drop)) or any(
            d < self.source_index for d in self.drop
        ):
            expected = f"distinct sorted source numbers >= source_index ({self.source_index})"
            raise FieldError("drop", expected, self.drop)


class Shard(CentralNode[Any]):
    kind = "shard"
    State = ShardState
    stamped = True

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> Shard:
        return cls(source, spec.options_as(ShardOptions).equalize, name=spec.name, ctx=ctx)

    def out_total(self, total: Total) -> Total | None:
        n = shard_length(total.items, self._equalize, self.ctx.rank, self.ctx.world_size)
        return attrs.evolve(total, items=n)

    def __init__(
        self, source: BaseNode[Any], equalize: str | None, *, name: str, ctx: RunContext
    ) -> None:
        super().__init__(source, name=name, ctx=ctx)
        self._equalize = equalize
        below = source.chain() if isinstance(source, CentralNode) else []
        #: The count stages before this one, whose totals items are stamped with.
        self.counts: list[Count] = [n for n in below if isinstance(n, Count)]
        self.index = 0
        self.base = 0
        self._round: list[Any] = []
        self._round_stamps: list[Stamp] = []
        self._done = False
        self._queue: deque[tuple[Any, Stamp | None]] = deque()
        self._source_index = 0
        self._drop: deque[int] = deque()
        #: Arrival stamp of the last item consumed; ``None``: the live counts.
        self.arrival: Stamp | None = None
        self._emitted: Stamp | None = None

    @property
    def equalize(self) -> str | None:
        return self._equalize

    def _live(self) -> Stamp:
        return tuple(map(_TOTALS, self.counts))

    def _consume(self) -> Any:
        """The next central item (queued first), with ``self.arrival`` set."""
        if self._queue:
            item, stamp = self._queue.popleft()
            self.arrival = stamp
            self.index += 1
            return item
        source = self.source
        assert source is not None
        drop = self._drop
        while True:
            item = next(source)
            n = self._source_index
            self._source_index = n + 1
            if drop and drop[0] == n:
                drop.popleft()
                continue
            self.arrival = None
            self.index += 1
            return item

    def produce(self) -> Any:
        ws, rank = self.ctx.world_size, self.ctx.rank
        counted = bool(self.counts)
        if self._equalize is None:
            while True:
                p = self.index - self.base
                item = self._consume()
                if p % ws == rank:
                    if counted:
                        arrival = self.arrival
                        self._emitted = (
                            arrival if arrival is not None else tuple(map(_TOTALS, self.counts))
                        )
                    return item
        if self._done:
            raise StopIteration
        rnd = self._round
        while True:
            try:
                item = self._consume()
            except StopIteration:
                self._done = True
                if self._equalize == "pad" and rnd:
                    k = rank % len(rnd)
                    out = rnd[k]
                    if counted:
                        self._emitted = self._round_stamps[k]
                    self._round, self._round_stamps = [], []
                    return out
                # drop_last keeps the round it dropped (and its stamps) in the
                # state: on another world size (``merge_states``) it may be whole.
                raise
            if counted:  # the stamp first: the round and its stamps stay aligned
                arrival = self.arrival
                self._round_stamps.append(
                    arrival if arrival is not None else tuple(map(_TOTALS, self.counts))
                )
            rnd.append(item)
            if len(rnd) == ws:
                out = rnd[rank]
                if counted:
                    self._emitted = self._round_stamps[rank]
                    self._round_stamps.clear()
                rnd.clear()
                return out

    def stamp(self) -> Any:
        """This stage's entry in an item's stamp, taken as it leaves the tip:
        ``index``, or ``[index, *arrival stamp of the item]`` when count
        stages precede the shard."""
        if not self.counts:
            return self.index
        return (self.index, *(self._emitted or ()))

    def count_stamp(self, k: int) -> tuple[int, float]:
        """The ``k``-th preceding count's totals as of the last consumed item."""
        if self.arrival is not None:
            return self.arrival[k]
        return self.counts[k].snapshot

    def own_state(self) -> dict[str, Any]:
        return {
            INDEX_KEY: self.index,
            ROUND_KEY: compact.encode_items(list(self._round)),
            DONE_KEY: self._done,
            BASE_KEY: self.base,
            QUEUE_KEY: compact.encode_items([item for item, _ in self._queue]),
            QUEUE_STAMPS_KEY: [_wire(s) for _, s in self._queue] if self.counts else [],
            ROUND_STAMPS_KEY: [_wire(s) for s in self._round_stamps],
            SOURCE_INDEX_KEY: self._source_index,
            DROP_KEY: list(self._drop),
        }

    def restore(self, state: dict[str, Any] | None) -> None:
        self.arrival = None
        self._emitted = None
        if state is None:
            self.index = self.base = self._source_index = 0
            self._round, self._round_stamps = [], []
            self._done = False
            self._queue = deque()
            self._drop = deque()
            return
        self.index = int(state[INDEX_KEY])
        self._round = compact.decode_items(state[ROUND_KEY])
        self._done = bool(state[DONE_KEY])
        # Checkpoints written before elastic resume have none of the keys below.
        self.base = int(state.get(BASE_KEY, 0))
        self._source_index = int(state.get(SOURCE_INDEX_KEY, self.index))
        self._drop = deque(int(x) for x in state.get(DROP_KEY, ()))
        queue = compact.decode_items(state.get(QUEUE_KEY, []))
        stamps: list[Stamp | None] = [_stamp(s) for s in state.get(QUEUE_STAMPS_KEY, ())]
        self._queue = deque(zip(queue, stamps or [None] * len(queue)))
        self._round_stamps = [_stamp(s) for s in state.get(ROUND_STAMPS_KEY, ())]
        if self.counts and len(self._round_stamps) != len(self._round):
            # An older checkpoint: the live counts are the best stamp there is.
            self._round_stamps = [self._live()] * len(self._round)

    def max_items_out(self, state: ShardState, bound_in: int | None) -> int | None:
        # Each output consumed an input since base, except the one "pad" may add at the end.
        return state.index - state.base + (self._equalize == "pad")

    def check_state(self, state: ShardState, states: Mapping[str, Any]) -> None:
        check_shard_state(
            state, (self._equalize,), world_size=self.ctx.world_size, counted=bool(self.counts)
        )


#: Every ``equalize`` mode: what :func:`check_shard_state` allows when the
#: pipeline is not at hand (``merge_states``).
ANY_EQUALIZE: tuple[str | None, ...] = ("drop_last", "pad", None)


def check_shard_state(
    state: ShardState, modes: tuple[str | None, ...], *, world_size: int, counted: bool
) -> None:
    """Raise ``FieldError`` unless ``state`` is a valid state of a shard with
    one of the ``equalize`` modes ``modes`` on ``world_size`` ranks (``counted``:
    count stages precede it); the error is that of the first mode."""
    errors = []
    for equalize in modes:
        try:
            _check_round(state, equalize, world_size, counted)
            return
        except FieldError as exc:
            errors.append(exc)
    raise errors[0]


def _check_round(state: ShardState, equalize: str | None, world_size: int, counted: bool) -> None:
    # The round holds the items of the current round of world_size so far
    # (rounds count from base; after the end, drop_last's dropped round);
    # a global state's round is empty.
    if state.done and equalize is None:
        raise FieldError("done", "False (equalize is None)", state.done)
    if equalize is None or (state.done and equalize == "pad"):
        if state.round:
            raise FieldError("round", "[] (no round is being filled)", state.round)
        return
    n = (state.index - state.base) % world_size
    # drop_last at the end: the round it dropped ([] from before it was kept).
    if len(state.round) != n and not (state.done and not state.round):
        expected = (
            f"{n} items ((index {state.index} - base {state.base}) mod world_size {world_size})"
        )
        if state.done:
            expected += ", the round drop_last dropped at the end, or []"
        raise FieldError("round", expected, state.round)
    if counted and len(state.round_stamps) != len(state.round):
        raise FieldError("round_stamps", "one count stamp per round item", state.round_stamps)
    if counted and len(state.queue_stamps) != len(state.queue):
        raise FieldError("queue_stamps", "one count stamp per queued item", state.queue_stamps)


def _wire(stamp: Stamp | None) -> list[list[Any]]:
    return [list(pair) for pair in stamp or ()]


def _stamp(value: Any) -> Stamp:
    return tuple((int(items), weight) for items, weight in value)


def shard_length(n: int, equalize: str | None, rank: int, world_size: int) -> int:
    """Items a rank gets from ``n`` central items."""
    if equalize == "drop_last":
        return n // world_size
    if equalize == "pad":
        return -(-n // world_size)
    return max(0, -(-(n - rank) // world_size))
