"""``pack``: sequences into groups of at most ``max_tokens``, first- or best-fit.

Items are placed as they arrive into *open groups* (online bin packing):

- ``"first_fit"`` puts an item into the oldest open group it fits in;
- ``"best_fit"`` into the open group it fills most (least room left; ties: the
  oldest).

An item that fits nowhere opens a new group. A group leaves as soon as it is
exactly full; and whenever the open groups hold more than ``buffer_size``
items, the oldest open group leaves, so no item waits for more than about
``buffer_size`` later items. At the end of the epoch the remaining groups leave
oldest first. The output depends only on the input order: deterministic, the
same on every rank and for any number of workers.

An item longer than ``max_tokens`` raises :class:`~centralpipe.PipelineError`
naming the stage and the length (``oversize="raise"``), or is dropped and
counted (``"drop"``). The state is the open groups (their items) and the totals
behind the fill rate (tokens in emitted groups / their capacity).

A length is an ``int >= 0`` (a numpy integer or a one-element integer tensor
is made one); anything else is a ``PipelineError`` naming the stage
(:mod:`centralpipe.stages.measures`). A checkpoint's open groups are measured
again when it is loaded: a group whose ``room`` is not ``max_tokens`` less its
items' lengths is refused.

An item stays in ``held`` (the state) from the moment it is pulled until it
is in a group, and a full group leaves at the start of the next call if an
interrupt (Ctrl-C) came first: an interrupted call loses nothing, and the
next one carries on. CPython handles a Ctrl-C only at a call, so each change
of the groups is written without a call (an append is a slice assignment,
``held`` emptied with ``del``), at most one call last. The index that finds
a group with room (the first-fit tree, the best-fit list) follows the
groups after each change and may be left behind by an interrupt: it may then
show a closed group, or more room than a group has, never less, and the
lookup checks what it finds against the groups and mends the entry; an
emitted group's entry is left for the lookup to drop. The placements are
those of an uninterrupted run.

Both strategies cost O(log open groups) per item: best-fit bisects a list of
``(room, group id)`` kept sorted; first-fit descends a max-tree of room over
group slots in age order.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from attrs import validators as v
from torchdata.nodes import BaseNode

from centralpipe.errors import PipelineError
from centralpipe.plan.options import PackOptions
from centralpipe.plan.specs import OVERSIZE, STRATEGIES, StageSpec
from centralpipe.stages.base import HELD, CentralNode, RunContext, Total, held_items, pull_one
from centralpipe.stages.measures import as_length
from centralpipe.validators import FieldError, checked, int_in, sequence_of

__all__ = ["OVERSIZE", "STRATEGIES", "Pack", "PackState"]

GROUPS_KEY = "groups"
EMITTED_KEY = "emitted"
TOKENS_KEY = "tokens"
DROPPED_KEY = "dropped"
DRAINING_KEY = "draining"

# An open group: [room left, items].
_ROOM, _ITEMS = 0, 1
_COUNT = int_in(0, 2**63)


def _open_group(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise TypeError(value)
    _COUNT(inst, attr, value[0])
    if not isinstance(value[1], (list, tuple)) or not value[1]:
        raise TypeError(value)


@attrs.frozen(kw_only=True)
class PackState:
    """Open groups ``[[room, [items]], ...]`` oldest first, and this epoch's totals."""

    groups: list[Any] = attrs.field(
        validator=checked(
            FieldError, "a list of [room, [items]] open groups", sequence_of(_open_group)
        )
    )
    emitted: int = attrs.field(validator=checked(FieldError, "an int >= 0", _COUNT))
    tokens: int = attrs.field(validator=checked(FieldError, "an int >= 0", _COUNT))
    dropped: int = attrs.field(validator=checked(FieldError, "an int >= 0", _COUNT))
    draining: bool = attrs.field(validator=checked(FieldError, "a bool", v.instance_of(bool)))
    held: list[Any] = attrs.field(factory=list, converter=held_items, validator=HELD)


class _FirstFitTree:
    """Leftmost slot whose room is >= n, over slots given out in age order.

    A max-tree over ``size`` leaves (a power of two at least twice the most
    groups ever open at once); when slots run out, the open groups are given
    slots ``0..k-1`` again in age order and the tree is rebuilt (amortised
    O(1) per group)."""

    def __init__(self, max_open: int) -> None:
        size = 1
        while size < 2 * max_open:
            size *= 2
        self.size = size
        self.tree = [-1] * (2 * size)
        self.ids: list[int] = [-1] * size
        #: Each group's slot (entries of closed groups linger until a rebuild).
        self.slot_of: dict[int, int] = {}
        self.next_slot = 0

    def find_slot(self, n: int) -> int | None:
        """The leftmost slot whose room (as the tree says) is >= n."""
        tree = self.tree
        if tree[1] < n:
            return None
        i, size = 1, self.size
        while i < size:
            i *= 2
            if tree[i] < n:
                i += 1
        return i - size

    def set(self, slot: int, room: int) -> None:
        tree = self.tree
        i = slot + self.size
        tree[i] = room
        i >>= 1
        while i:
            left, right = tree[2 * i], tree[2 * i + 1]
            tree[i] = left if left >= right else right
            i >>= 1

    def add(self, gid: int, room: int, groups: dict[int, list[Any]], order: deque[int]) -> None:
        if self.next_slot == self.size:
            self.rebuild(groups, order)
        slot = self.next_slot
        self.next_slot = slot + 1
        self.ids[slot] = gid
        self.slot_of[gid] = slot
        self.set(slot, room)

    def rebuild(self, groups: dict[int, list[Any]], order: deque[int]) -> None:
        """The open groups in slots ``0..k-1`` by age, built aside and put in
        place at once (an interrupt leaves the old tree whole)."""
        size = self.size
        tree = [-1] * (2 * size)
        ids = [-1] * size
        slot_of: dict[int, int] = {}
        slot = 0
        for gid in order:
            group = groups.get(gid)
            if group is None or gid in slot_of:
                continue
            slot_of[gid] = slot
            ids[slot] = gid
            tree[size + slot] = group[_ROOM] if group[_ROOM] else -1
            slot += 1
        for i in range(size - 1, 0, -1):
            left, right = tree[2 * i], tree[2 * i + 1]
            tree[i] = left if left >= right else right
        self.tree, self.ids, self.slot_of, self.next_slot = tree, ids, slot_of, slot


class Pack(CentralNode[list[Any]]):
    kind = "pack"
    State = PackState

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> Pack:
        o = spec.options_as(PackOptions)
        return cls(
            source,
            spec.fn,
            max_tokens=o.max_tokens,
            strategy=o.strategy,
            buffer_size=o.buffer_size,
            oversize=o.oversize,
            name=spec.name,
            ctx=ctx,
        )

    def out_total(self, total: Total) -> Total | None:
        return total.at_most(self.name)  # every group holds at least one item

    def __init__(
        self,
        source: BaseNode[Any],
        len_fn: Callable[[Any], int],
        *,
        max_tokens: int,
        strategy: str,
        buffer_size: int,
        oversize: str,
        name: str,
        ctx: RunContext,
    ) -> None:
        super().__init__(source, name=name, ctx=ctx)
        self._len_fn = len_fn
        self._max = max_tokens
        self._best = strategy == "best_fit"
        self._buffer_size = buffer_size
        self._drop = oversize == "drop"
        self._clear()

    def _clear(self) -> None:
        self._groups: dict[int, list[Any]] = {}
        self._order: deque[int] = deque()  # group ids by age; closed ones skipped lazily
        self._by_room: list[tuple[int, int]] = []  # best-fit: sorted (room, id)
        self._tree = None if self._best else _FirstFitTree(self._buffer_size + 1)
        self._next_id = 0
        self._buffered = 0
        #: A group that is full and has not left yet (-1: none).
        self._full = -1
        self._emitted = 0
        self._tokens = 0
        self._dropped = 0
        self._draining = False

    def produce(self) -> list[Any]:
        source = self.source
        assert source is not None
        groups, held = self._groups, self.held
        while True:
            # What a call interrupted before returning it (Ctrl-C) left to emit
            # goes first; otherwise these are checked right after an item is placed.
            if self._full >= 0:
                return self._emit(self._full)
            if self._buffered > self._buffer_size:
                return self._emit(self._oldest())
            if self._draining:
                if not groups:
                    raise StopIteration
                return self._emit(self._oldest())
            if not held:
                try:
                    pull_one(source, held)
                except StopIteration:
                    self._draining = True
                    continue
            # The item stays held until it is placed: the calls below may be
            # interrupted, and the next call places it then.
            item = held[0]
            try:
                n = self._length(item)
            except BaseException as exc:
                if isinstance(exc, Exception):  # a failure: the item is dropped
                    held.clear()
                raise
            if n > self._max:
                held.clear()
                if self._drop:
                    self._dropped += 1
                    continue
                msg = (
                    f"stage '{self.name}': an item of length {n} is longer than "
                    f"max_tokens={self._max}; split such items before pack(), or pass "
                    f"oversize='drop' to drop them (counted in query('{self.name}'))."
                )
                raise PipelineError(msg)
            gid = self._find(n)
            if gid is None:
                self._open(self._max - n, [item])
            else:
                self._place(gid, item, n)

    def _length(self, item: Any) -> int:
        n = self._len_fn(item)
        return n if type(n) is int and n >= 0 else as_length(n, self.name)

    def _find(self, n: int) -> int | None:
        """The open group the strategy puts an item of length ``n`` in. The
        index may be behind the groups after an interrupt (see the module
        docstring): what it finds is checked, and a stale entry mended."""
        groups = self._groups
        if self._best:
            rooms = self._by_room
            while True:
                i = bisect.bisect_left(rooms, (n, -1))
                if i == len(rooms):
                    return None
                room, gid = rooms[i]
                group = groups.get(gid)
                if group is not None and group[_ROOM] == room:
                    return gid
                del rooms[i]  # a closed group, or a room since used
        tree = self._tree
        assert tree is not None
        while True:
            slot = tree.find_slot(n)
            if slot is None:
                return None
            gid = tree.ids[slot]
            group = groups.get(gid)
            # What the slot should show: the group's room, -1 when it is full,
            # closed, or the slot is not its own (an add an interrupt cut short).
            room = -1
            if group is not None and tree.slot_of.get(gid) == slot and group[_ROOM]:
                room = group[_ROOM]
            if room >= n:
                return gid
            tree.set(slot, room)

    # Opening, placing and emitting write the groups without a call, and make
    # at most one call after that; the index is updated around it (see the
    # module docstring): an interrupt (Ctrl-C) finds every group and the held
    # item whole, and a full group leaves at the next call.

    def _open(self, room: int, items: list[Any]) -> None:
        """A new group holding ``items`` with ``room`` left (the held item placed)."""
        gid = self._next_id
        group: list[Any] = [room, items]
        count = len(items)
        # Indexed before it is registered: an entry of a group never opened
        # (an interrupt here) is dropped by _find.
        if not self._best:
            assert self._tree is not None
            self._tree.add(gid, room if room else -1, self._groups, self._order)
        elif room:  # a full group leaves at once; keep it out of the index
            rooms = self._by_room
            i = bisect.bisect_left(rooms, (room, gid))
            rooms[i:i] = ((room, gid),)
        held = self.held
        # From here no call but the last.
        self._next_id = gid + 1
        self._groups[gid] = group
        self._buffered += count
        del held[:]
        if not room:
            self._full = gid
        self._order.append(gid)

    def _place(self, gid: int, item: Any, n: int) -> None:
        """Put the held ``item`` (length ``n``) into open group ``gid``."""
        group = self._groups[gid]
        items = group[_ITEMS]
        k = len(items)
        old = group[_ROOM]
        new = old - n
        held = self.held
        rooms = self._by_room
        if self._best and new:
            # The entry of the new room first: until the groups change it is
            # one _find drops (not the group's room), after they have it is exact.
            i = bisect.bisect_left(rooms, (new, gid))
            rooms[i:i] = ((new, gid),)
        # The groups, without a call: the item in its group, out of held.
        group[_ROOM] = new
        items[k:] = (item,)
        self._buffered += 1
        del held[:]
        if not new:
            self._full = gid
        # Then the old entry goes (an interrupt leaves it: the tree's leaf or
        # the list's entry shows the old, larger room, which _find mends).
        if self._best:
            j = bisect.bisect_left(rooms, (old, gid))
            if j < len(rooms) and rooms[j] == (old, gid):
                del rooms[j]
        else:
            assert self._tree is not None
            self._tree.set(self._tree.slot_of[gid], new if new else -1)

    def _oldest(self) -> int:
        order, groups = self._order, self._groups
        while order[0] not in groups:
            order.popleft()
        return order[0]

    def _emit(self, gid: int) -> list[Any]:
        """Group ``gid`` leaves. Its index entry stays, for _find to drop:
        from the group's removal to the return there is no call."""
        groups = self._groups
        group = groups[gid]
        room, items = group[_ROOM], group[_ITEMS]
        count = len(items)
        if len(self._order) > 4 * (len(groups) - 1) + 64:
            # Closed groups behind a long-open one: drop their ids from the age order.
            self._order = deque(filter(groups.__contains__, self._order))
        del groups[gid]
        self._buffered -= count
        self._emitted += 1
        self._tokens += self._max - room
        self._full = -1
        return items

    # -- state ----------------------------------------------------------------------

    def own_state(self) -> dict[str, Any]:
        groups = self._groups
        open_groups = [
            [groups[gid][_ROOM], list(groups[gid][_ITEMS])] for gid in self._order if gid in groups
        ]
        return self.with_held(
            {
                GROUPS_KEY: open_groups,
                EMITTED_KEY: self._emitted,
                TOKENS_KEY: self._tokens,
                DROPPED_KEY: self._dropped,
                DRAINING_KEY: self._draining,
            }
        )

    def restore(self, state: dict[str, Any] | None) -> None:
        self._clear()
        if state is None:
            self.restore_held(None)
            return
        for room, items in state[GROUPS_KEY]:
            self._open(int(room), list(items))
        self.restore_held(state)
        self._emitted = int(state[EMITTED_KEY])
        self._tokens = int(state[TOKENS_KEY])
        self._dropped = int(state[DROPPED_KEY])
        self._draining = bool(state[DRAINING_KEY])

    def check_state(self, state: PackState, states: Mapping[str, Any]) -> None:
        # After an interrupt one full group (room 0) may not have left yet, and
        # the groups may hold one item more than buffer_size (the oldest leaves next).
        self.check_held(state.held, 0 if state.draining else 1)
        full = 0
        for i, (room, items) in enumerate(state.groups):
            if not 0 <= room <= self._max or (room == 0 and full):
                expected = f"room in 0..max_tokens={self._max}, 0 for one group at most"
                raise FieldError(f"groups[{i}][0]", expected, room)
            full += room == 0
            self._check_room(i, room, items)
        held = sum(len(items) for _, items in state.groups)
        if held > self._buffer_size + 1:
            expected = f"at most buffer_size + 1 = {self._buffer_size + 1} items in open groups"
            raise FieldError("groups", expected, f"{held} items")
        if state.tokens > state.emitted * self._max:
            expected = f"<= emitted * max_tokens = {state.emitted * self._max}"
            raise FieldError("tokens", expected, state.tokens)

    def _check_room(self, i: int, room: int, items: list[Any]) -> None:
        """Open group ``i``'s ``room`` is ``max_tokens`` less its items' lengths
        (``len_fn`` measures them again: at most ``buffer_size + 1`` calls)."""
        try:
            used = sum(self._length(item) for item in items)
        except Exception as exc:
            expected = "items that len_fn measures"
            raise FieldError(f"groups[{i}][1]", expected, f"{type(exc).__name__}: {exc}") from None
        if used > self._max:
            expected = f"items of at most max_tokens={self._max} tokens in all"
            raise FieldError(f"groups[{i}][1]", expected, f"{used} tokens")
        if room != self._max - used:
            expected = (
                f"max_tokens less the group's {used} tokens = {self._max} - {used} = "
                f"{self._max - used}"
            )
            raise FieldError(f"groups[{i}][0]", expected, room)

    def max_items_out(self, state: PackState, bound_in: int | None) -> int | None:
        return state.emitted

    def query_state(self) -> dict[str, Any]:
        capacity = self._emitted * self._max
        return {
            "groups": self._emitted,
            "tokens": self._tokens,
            "capacity": capacity,
            "fill_rate": self._tokens / capacity if capacity else None,
            "dropped": self._dropped,
            "buffered": self._buffered,
            "open_groups": len(self._groups),
            "draining": self._draining,
        }
