"""``batch`` and ``bucket_by_max_tokens``.

``bucket_by_max_tokens`` follows torchdata's ``MaxTokenBucketizer``: items go
into a min-heap keyed by length; whenever the heap holds ``buffer_size`` items
(or the source is exhausted) the shortest is popped into the running batch,
and the batch is emitted when adding the next item would exceed
``max_tokens``. Ties in length keep arrival order (torchdata compared the items
themselves, which fails for items that do not order). An item longer than
``max_tokens`` is emitted alone; an empty batch is never emitted. A length is
an ``int >= 0`` (a numpy integer or a one-element integer tensor is made one);
anything else — a float, ``nan``, a negative number, a ``str`` — is a
``PipelineError`` naming the stage (:mod:`centralpipe.stages.measures`).

Both pull in bulk (``pull_into``: a parallel stage before them hands over a
whole chunk's outputs at once): ``batch`` the rest of its group, the bucket
``PULL_BULK`` inputs ahead. Both keep what they pulled in their state, never
in a local variable across a call that an interrupt (Ctrl-C) can cut short:
``batch`` gathers its group in ``held``; the bucket keeps the inputs it pulled
and has not pushed yet in ``held`` (a ``len_fn`` that raises drops its input
only; the ones after it stay held). The next ``next()`` carries on from
there, and a checkpoint taken meanwhile records it. The heap, the batch and
the held inputs are saved compact when they are 1-D arrays
(:mod:`centralpipe.checkpoint.compact`); the heap is kept as segments as it
changes (:mod:`centralpipe.checkpoint.table`), so a state costs the entries
pushed and popped since the last one: the arena learns of each push and pop
just before the heap call, and ``_settle`` finishes one an interrupt cut
short between the two.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from attrs import validators as v
from torchdata.nodes import BaseNode

from centralpipe.checkpoint import compact, table
from centralpipe.plan.options import BatchOptions, BucketOptions
from centralpipe.plan.specs import StageSpec
from centralpipe.stages.base import (
    HELD,
    HELD_KEY,
    CentralNode,
    HeldState,
    RunContext,
    Total,
    held_items,
    pull_one,
)
from centralpipe.stages.measures import as_length
from centralpipe.validators import FieldError, checked, int_in, sequence_of

__all__ = ["Batch", "BucketByMaxTokens", "BucketState"]

HEAP_KEY = "heap"
BATCH_KEY = "batch"
BATCH_TOKENS_KEY = "batch_tokens"
BATCH_MAX_KEY = "batch_max_len"
ARRIVALS_KEY = "arrivals"
DRAINING_KEY = "draining"
#: A batch made and not handed out yet (present only then, after an interrupt).
READY_KEY = "ready"
#: Inputs a bucket pulls from its source at once (held until pushed).
PULL_BULK = 64
#: The int columns of a heap saved compact (``checkpoint.compact``).
HEAP_COLUMNS = ("length", "arrival")


def _heap(value: Any) -> Any:
    try:
        return table.decode_heap(value)
    except ValueError as exc:
        raise FieldError(HEAP_KEY, f"a list or a readable compact heap ({exc})", value) from None


_COUNT = int_in(0, 2**63)


def _heap_entry(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise TypeError(value)
    _COUNT(inst, attr, value[0])
    _COUNT(inst, attr, value[1])


def _decoded_batch(value: Any) -> list[Any]:
    items: list[Any] = compact.decoded_items(BATCH_KEY, value)
    return items


def _decoded_ready(value: Any) -> list[Any]:
    items: list[Any] = compact.decoded_items(READY_KEY, value)
    return items


@attrs.frozen(kw_only=True)
class BucketState:
    """The heap ``[[length, arrival, item], ...]`` (saved compact as
    ``{"length": tensor, "arrival": tensor, "items": ...}`` when the items are
    1-D arrays: ``checkpoint.compact``), the batch being filled and counters."""

    heap: list[Any] = attrs.field(
        converter=_heap,
        validator=checked(
            FieldError, "a list of [length, arrival, item] entries", sequence_of(_heap_entry)
        ),
    )
    batch: list[Any] = attrs.field(
        converter=_decoded_batch,
        validator=checked(FieldError, "a list", sequence_of()),
    )
    batch_tokens: int = attrs.field(validator=checked(FieldError, "an int >= 0", _COUNT))
    batch_max_len: int = attrs.field(validator=checked(FieldError, "an int >= 0", _COUNT))
    arrivals: int = attrs.field(validator=checked(FieldError, "an int >= 0", _COUNT))
    draining: bool = attrs.field(validator=checked(FieldError, "a bool", v.instance_of(bool)))
    held: list[Any] = attrs.field(factory=list, converter=held_items, validator=HELD)
    ready: list[Any] = attrs.field(
        factory=list,
        converter=_decoded_ready,
        validator=checked(FieldError, "a list (a batch not handed out yet)", sequence_of()),
    )


class Batch(CentralNode[list[Any]]):
    kind = "batch"
    State = HeldState

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> Batch:
        o = spec.options_as(BatchOptions)
        return cls(source, o.batch_size, o.drop_last, name=spec.name, ctx=ctx)

    def out_total(self, total: Total) -> Total | None:
        size, n = self._batch_size, total.items
        return attrs.evolve(total, items=n // size if self._drop_last else -(-n // size))

    def __init__(
        self, source: BaseNode[Any], batch_size: int, drop_last: bool, *, name: str, ctx: RunContext
    ) -> None:
        super().__init__(source, name=name, ctx=ctx)
        self._batch_size = batch_size
        self._drop_last = drop_last

    def max_items_out(self, state: Any, bound_in: int | None) -> int | None:
        return bound_in

    def produce(self) -> list[Any]:
        assert self.source is not None
        # The group being gathered is the state (``held``), not a local: an
        # interrupt at a nested next() leaves it for the next call.
        out, source, size = self.held, self.source, self._batch_size
        bulk = isinstance(source, CentralNode)
        while len(out) < size:
            try:
                if bulk:  # the rest of the group at once (see pull_into)
                    source.pull_into(out, size - len(out))
                else:
                    pull_one(source, out)
            except StopIteration:
                break
        # Decided before the group leaves ``held``: from there to the return
        # no call is made, so no Ctrl-C can drop the group.
        if not out or (self._drop_last and len(out) < size):
            self.held = []
            raise StopIteration
        self.held = []
        return out

    def own_state(self) -> dict[str, Any]:
        return self.with_held({})

    def restore(self, state: dict[str, Any] | None) -> None:
        self.restore_held(state)

    def check_state(self, state: HeldState, states: Mapping[str, Any]) -> None:
        # A whole group when a Ctrl-C came after it was gathered, before it went out.
        self.check_held(state.held, self._batch_size)


class BucketByMaxTokens(CentralNode[list[Any]]):
    kind = "bucket_by_max_tokens"
    State = BucketState

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> BucketByMaxTokens:
        o = spec.options_as(BucketOptions)
        return cls(
            source,
            spec.fn,
            max_tokens=o.max_tokens,
            buffer_size=o.buffer_size,
            min_len=o.min_len,
            max_len=o.max_len,
            include_padding=o.include_padding,
            name=spec.name,
            ctx=ctx,
        )

    def out_total(self, total: Total) -> Total | None:
        return total.at_most(self.name)  # every batch holds at least one item

    def __init__(
        self,
        source: BaseNode[Any],
        len_fn: Callable[[Any], int],
        *,
        max_tokens: int,
        buffer_size: int | None,
        min_len: int,
        max_len: int | None,
        include_padding: bool,
        name: str,
        ctx: RunContext,
    ) -> None:
        super().__init__(source, name=name, ctx=ctx)
        self._len_fn = len_fn
        #: The source hands out inputs in bulk (``pull_into``).
        self._bulk = isinstance(source, CentralNode)
        self._max_tokens = max_tokens
        self._buffer_size = buffer_size
        self._min_len = min_len
        self._max_len = max_len
        self._padding = include_padding
        self._clear()

    def _clear(self) -> None:
        # heap entries: (length, arrival index, item); the index breaks ties.
        self._heap: list[tuple[int, int, Any]] = []
        self._batch: list[Any] = []
        self._batch_tokens = 0
        self._batch_max = 0
        self._arrivals = 0
        self._draining = False
        self._taken = 0  # inputs at the front of ``held`` already pushed or dropped
        self._ready: list[Any] | None = None  # a batch made and not handed out yet
        self._ended = False  # the source raised StopIteration this epoch
        # The heap's saved form, kept as it changes (checkpoint.table).
        self._arena = table.HeapArena()

    def _settle(self) -> None:
        """Finish a push or pop that an interrupt cut short between the
        arena's bookkeeping and the heap call (one at most: each is followed
        by a heap call, and every entry point settles first)."""
        arena, heap = self._arena, self._heap
        if arena.off:
            return
        missing = arena.count() - len(heap)
        if missing == 1:  # pushed to the arena, not to the heap
            heapq.heappush(heap, arena.pending[-1])
        elif missing == -1:  # popped in the arena (and placed), not from the heap
            heapq.heappop(heap)

    def produce(self) -> list[Any]:
        assert self.source is not None
        heap, cap = self._heap, self._buffer_size
        self._settle()
        while True:
            ready = self._ready
            if ready is not None:
                self._ready = None
                return ready
            if not self._draining:
                self._fill(heap, cap)  # returns with a batch ready, or draining
                continue
            if not heap:
                if self._batch:
                    out, self._batch = self._batch, []
                    self._batch_tokens = self._batch_max = 0
                    return out
                raise StopIteration
            self._pop_one()

    def _fill(self, heap: list[tuple[int, int, Any]], cap: int | None) -> None:
        """Push inputs until a batch is ready (a full heap pops its shortest
        into the batch before each push: :meth:`_pop_one`) or the source
        ends (then ``draining``).

        Inputs are pulled ``PULL_BULK`` at a time into ``held``; ``held[:_taken]``
        are already pushed or dropped. Each input moves from ``held`` to the
        heap with no call between the bookkeeping and the push, and the push
        (a C call) is the last step, so an interrupt handled after any call
        leaves every input either held or pushed, never both or neither; a
        ``len_fn`` that raises drops its input only, the inputs after it stay
        held for the next call. The entry goes to the arena just before the
        push: an interrupt between them is finished by ``_settle``."""
        source, len_fn = self.source, self._len_fn
        bulk = self._bulk
        min_len, max_len = self._min_len, self._max_len
        held = self.held
        arena = self._arena
        while True:
            if cap is not None and len(heap) >= cap:
                # The steady state: one pop per push, here rather than a
                # return to produce() and a call back for every input.
                self._pop_one()
                if self._ready is not None:
                    return
                continue
            if not arena.off and arena.full():
                arena.seal()  # bounds what it keeps between rare checkpoints
            taken = self._taken
            if taken >= len(held):
                if held:
                    self.held = held = []
                    self._taken = taken = 0
                if self._ended:
                    self._draining = True
                    return
                try:
                    if bulk:
                        source.pull_into(held, PULL_BULK)  # type: ignore[union-attr]
                    else:
                        pull_one(source, held)
                except StopIteration:
                    self._ended = True
                    if not held:
                        self._draining = True
                        return
            item = held[taken]
            try:
                length = len_fn(item)
                if type(length) is not int or length < 0:
                    length = as_length(length, self.name)
            except Exception:
                self._taken = taken + 1  # this input is dropped, the pass goes on after it
                raise
            if length < min_len or (max_len is not None and length > max_len):
                self._taken = taken + 1
                continue
            arrival = self._arrivals
            entry = (length, arrival, item)
            self._arrivals = arrival + 1
            self._taken = taken + 1
            if not arena.off:
                arena.pending.append(entry)
            heapq.heappush(heap, entry)

    def _pop_one(self) -> None:
        """Move the shortest buffered item into the batch; the batch it
        displaces when it would overflow ``max_tokens`` (or a lone item longer
        than that) becomes ``_ready``, the next output.

        The item is read at ``heap[0]`` and placed first; the ``heappop``
        that removes it from the heap is the last call, so an interrupt
        handled after any call finds it in exactly one place, and a batch
        that left ``_batch`` is already in ``_ready`` (kept in the state).
        The arena learns of the pop just before it (``_settle`` finishes a
        pop cut short there)."""
        heap, arena = self._heap, self._arena
        length, arrival, item = heap[0]
        longest = self._batch_max
        if length > longest:
            longest = length
        if self._padding:
            tokens = (len(self._batch) + 1) * longest
        else:
            tokens = self._batch_tokens + length
        if tokens > self._max_tokens and self._batch:
            self._ready = self._batch
            self._batch = [item]
            self._batch_tokens = length
            self._batch_max = length
            if not arena.off:
                arena.removed.append(arrival)
            heapq.heappop(heap)
            return
        self._batch += [item]  # an in-place add, not a call: no interrupt lands here
        self._batch_tokens = tokens if not self._padding else self._batch_tokens + length
        self._batch_max = longest
        if tokens > self._max_tokens:
            # A lone item longer than max_tokens goes out by itself.
            self._ready = self._batch
            self._batch = []
            self._batch_tokens = self._batch_max = 0
        if not arena.off:
            arena.removed.append(arrival)
        heapq.heappop(heap)

    def own_state(self) -> dict[str, Any]:
        self._settle()
        state = {
            HEAP_KEY: self._arena.state(self._heap),
            BATCH_KEY: compact.encode_items(self._batch),
            BATCH_TOKENS_KEY: self._batch_tokens,
            BATCH_MAX_KEY: self._batch_max,
            ARRIVALS_KEY: self._arrivals,
            DRAINING_KEY: self._draining,
        }
        # Always present (empty when unused): a torch.distributed.checkpoint
        # load fills only the keys of its template, a fresh loader's state.
        state[READY_KEY] = compact.encode_items(self._ready or [])
        state[HELD_KEY] = compact.encode_items(self.held[self._taken :])
        return state

    def max_items_out(self, state: BucketState, bound_in: int | None) -> int | None:
        return state.arrivals  # every batch holds at least one arrived item

    def check_state(self, state: BucketState, states: Mapping[str, Any]) -> None:
        self.check_held(state.held, 0 if state.draining else PULL_BULK)
        if self._buffer_size is not None and len(state.heap) > self._buffer_size:
            raise FieldError("heap", f"at most buffer_size={self._buffer_size} entries", state.heap)
        for length, arrival, _ in state.heap:
            if arrival >= state.arrivals:
                raise FieldError("heap", f"arrival indexes < arrivals ({state.arrivals})", arrival)
            if length < self._min_len or (self._max_len is not None and length > self._max_len):
                expected = f"lengths in [min_len, max_len] = [{self._min_len}, {self._max_len}]"
                raise FieldError("heap", expected, length)

    def restore(self, state: dict[str, Any] | None) -> None:
        self._clear()
        self.restore_held(state)
        if state is None:
            return
        heap = table.decode_heap(state[HEAP_KEY])
        entries = sorted((int(n), int(i), item) for n, i, item in heap)
        self._heap = entries  # sorted: a heap already
        # (the arena is dormant: the next state encodes the heap whole)
        self._batch = compact.decode_items(state[BATCH_KEY])
        self._batch_tokens = int(state[BATCH_TOKENS_KEY])
        self._batch_max = int(state[BATCH_MAX_KEY])
        self._arrivals = int(state[ARRIVALS_KEY])
        self._draining = bool(state[DRAINING_KEY])
        ready = compact.decode_items(state.get(READY_KEY, []))
        self._ready = ready or None

    def query_state(self) -> dict[str, Any]:
        return {
            "buffered": len(self._heap),
            "batch_items": len(self._batch),
            "batch_tokens": self._batch_tokens,
            "seen": self._arrivals,
            "draining": self._draining,
        }
