"""A chunk: consecutive dispatched items of one stream, and their life.

A :class:`Chunk` never crosses the pipe (its message is built by
:func:`~centralpipe.dispatch.wire.protocol.chunk_message` from its fields);
it is the main process's record of those items from the moment they are
pulled until they are delivered:

- *filling* (``dispatch.pull``): items are appended to ``items`` (and their
  stamps to ``stamps``) in place, then :meth:`Chunk.close` makes it final;
- *sent* (``dispatch.sender``): :meth:`Chunk.assign` picks its worker slot
  once, :meth:`Chunk.mark_sent` / :meth:`Chunk.mark_unsent` record whether
  that slot's current worker generation has it;
  :meth:`Chunk.resend_per_item` asks for it again item by item;
- *result in* (``dispatch.supervisor``, or run inline): :meth:`Chunk.put_result`;
  its bytes held until delivery (``dispatch.budget``): :meth:`Chunk.hold_bytes`,
  :meth:`Chunk.release_bytes`;
- *delivered* (``reorder.Stream``): :meth:`Chunk.mark_raised` for the input
  whose failure was raised, :meth:`Chunk.put_pinned` for pinned outputs.

Every transition is a method here, and each writes its slots with no call
between the writes (CPython handles a Ctrl-C at a Python function's entry,
after a call into C returns and on a backward jump): an interrupt lands at
the method's entry, before any write, or after them all. So a caller may
put a transition first or last in its own section of writes without a new
place for an interrupt to land in the middle. The hot path stays per chunk:
items are appended to ``items`` in place, never through a method.
"""

from __future__ import annotations

from typing import Any

from centralpipe.dispatch.wire import tokens
from centralpipe.dispatch.wire.protocol import ChunkResult, StageFailure

__all__ = ["Chunk"]


class Chunk:
    """Consecutive dispatched items (``first_seq`` …) sent as one message.

    Read any slot freely; change them only through the methods (the module
    docstring lists who calls which). ``items`` and ``stamps`` are filled in
    place by the pull while the chunk is open."""

    __slots__ = (
        "bad_skip",
        "cid",
        "closed",
        "first_seq",
        "flats",
        "held_bytes",
        "items",
        "per_item",
        "pinned",
        "raised_at",
        "result",
        "sent_gen",
        "skip",
        "skip_first",
        "slot",
        "stamps",
        "state_part",
        "unsendable",
    )

    def __init__(self, cid: int, first_seq: int, stamped: bool) -> None:
        self.cid = cid
        self.first_seq = first_seq
        self.items: list[Any] = []
        self.stamps: list[Any] | None = [] if stamped else None
        self.slot = -1
        self.sent_gen = -1
        self.result: ChunkResult | None = None
        self.skip: set[int] = set()  # input indexes not to run (poison items)
        self.skip_first = 0  # outputs of input 0 delivered before a resume
        self.bad_skip = ""  # why skip_first cannot be right (a damaged checkpoint)
        self.closed = False
        self.raised_at = -1  # input whose failure was raised to the consumer
        # inputs that cannot be pickled (failures at the boundary stage) and
        # poison items (with on_error="raise"): failures known before a result
        self.unsendable: list[StageFailure] = []
        self.pinned: Any = None  # a Future of the pinned outputs (pin_memory=True)
        self.per_item = False  # items and outputs sealed one by one (wire.protocol)
        self.held_bytes = 0  # bytes its result holds until delivered (dispatch.budget)
        # The items as sent when each is a list of arrays (wire.tokens), and
        # their checkpoint form once made (checkpoint.compact): (item count, part).
        self.flats: list[tokens.Flat] | None = None
        self.state_part: tuple[int, Any] | None = None

    # -- filling (dispatch.pull) -------------------------------------------------

    def set_items(self, items: Any) -> None:
        """Its items are ``items`` (a list, or a range of lines read by a worker)."""
        self.items = items

    def take_resumed(self, items: Any, skip: set[int], skip_first: int | None) -> None:
        """Its items are ``items`` of a checkpoint's in-flight inputs, with
        the inputs not to run and (``skip_first`` not ``None``) the outputs
        of input 0 delivered before that checkpoint."""
        self.skip = skip
        if skip_first is not None:
            self.skip_first = skip_first
        self.items = items

    def add_resumed(self, item: Any, stamp: Any, poison: bool, skip_first: int | None) -> None:
        """Append one in-flight input of a checkpoint (and its stamp): not
        run if ``poison``; ``skip_first`` not ``None``: its outputs delivered
        before that checkpoint. The item is appended last: a stamp (or a
        skip) beyond the items is dropped by the pull's clean-up."""
        if poison:
            self.skip.add(len(self.items))
        if skip_first is not None:
            self.skip_first = skip_first
        if self.stamps is not None:
            self.stamps.append(stamp)
        self.items.append(item)

    def close(self) -> None:
        """Its items are final: it is sent or run as it is."""
        self.closed = True

    # -- sending (dispatch.sender) ----------------------------------------------

    def assign(self, slot: int) -> None:
        """The worker slot it goes to (once: a re-send goes to the same slot)."""
        self.slot = slot

    def mark_sent(self, gen: int) -> None:
        """Generation ``gen`` of its slot's worker has it (or is being sent it)."""
        self.sent_gen = gen

    def mark_unsent(self) -> None:
        """No worker is known to have it (a send cut short, or to be re-sent)."""
        self.sent_gen = -1

    def seal_per_item(self) -> None:
        """Each item (and its outputs) is sealed on its own from now on."""
        self.per_item = True

    def resend_per_item(self) -> None:
        """Send it again, each item (and its outputs) sealed on its own: no
        worker has it in that form."""
        self.per_item = True
        self.sent_gen = -1

    def set_flats(self, flats: list[tokens.Flat] | None) -> None:
        """The flat buffers its items were sent as (``None``: not all flat)."""
        self.flats = flats

    def set_unsendable(self, failures: list[StageFailure]) -> None:
        """The failures known before a result (a new list: readers may iterate the old)."""
        self.unsendable = failures

    def add_failure(self, failure: StageFailure) -> None:
        """One more failure known before a result (a poison item with
        ``on_error="raise"``); a new list: readers may be iterating the old one."""
        self.unsendable = [*self.unsendable, failure]

    def add_skip(self, at: int) -> None:
        """Do not run input ``at`` (a poison item with ``on_error="skip"``);
        a new set: readers may be iterating the old one."""
        self.skip = self.skip | {at}

    # -- results (dispatch.supervisor, dispatch.budget, reorder.Stream) ---------

    def put_result(self, result: ChunkResult) -> None:
        """Its result is in (ready for delivery once it is the head chunk)."""
        self.result = result

    def put_pinned(self, result: ChunkResult) -> None:
        """Its result with the pinned outputs; the pin is no longer awaited."""
        self.result = result
        self.pinned = None

    def set_pinned(self, future: Any) -> None:
        """The pin thread's future of its pinned outputs."""
        self.pinned = future

    def mark_bad_skip(self, text: str) -> None:
        """Its ``skip_first`` cannot be right: ``text`` says why (raised at delivery)."""
        self.bad_skip = text

    def hold_bytes(self, nbytes: int) -> None:
        """Its result holds ``nbytes`` bytes until delivered (``dispatch.budget``)."""
        self.held_bytes = nbytes

    def release_bytes(self) -> int:
        """Its bytes are released; the bytes it held (``-1``: released before)."""
        nbytes = self.held_bytes
        self.held_bytes = -1
        return nbytes

    def mark_raised(self, at: int) -> None:
        """The failure of input ``at`` was raised to the consumer."""
        self.raised_at = at

    # -- checkpoints (dispatch.capture) -----------------------------------------

    def cache_state_part(self, n: int, part: Any) -> None:
        """The checkpoint form of its ``n`` items, kept once they are final."""
        self.state_part = (n, part)
