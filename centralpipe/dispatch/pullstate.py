"""The pull's part of a stream's state (:mod:`centralpipe.dispatch.pull`).

A :class:`~centralpipe.dispatch.reorder.Stream` holds one :class:`PullState`
(``stream.pulls``); only ``dispatch.pull`` changes it, in the thread that
pulls, under the stream's ``lock`` where a checkpoint reads it
(``dispatch.capture`` reads ``resume``, ``skip`` and ``skip_first``):

- ``resume``: a checkpoint's in-flight inputs still to dispatch again, first,
  in ``seq`` order: ``(seq, item, stamp)``, a range of lines read by workers
  staying one entry (one chunk) as ``(seq, lines, None)``;
- ``skip``: the seqs among them not to run (poison items), and
  ``skip_first``: ``(seq, outputs of it delivered before the checkpoint)``;
- ``burst``: items pulled between two looks at the clock, adapted to the
  measured cost of the central chain;
- ``took``: a range of lines the reader has handed out and the pull has not
  yet stored in its chunk (what a Ctrl-C between the two leaves).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from centralpipe.checkpoint.model import Boundary

__all__ = ["PullState"]


class PullState:
    """What :func:`~centralpipe.dispatch.pull.pull_chunk` keeps between chunks."""

    __slots__ = ("burst", "resume", "skip", "skip_first", "took")

    def __init__(
        self, resume: Boundary | None = None, ranges: Sequence[tuple[int, Any]] = ()
    ) -> None:
        """``resume``: the checkpoint's entry of this boundary; ``ranges``:
        its in-flight byte ranges as ``(at, lines)``, a sequence of lines that
        comes before ``resume.items[at]`` (read by the stream's tip)."""
        self.burst = 1
        self.took: list[Any] = []
        self.resume: deque[tuple[int, Any, Any]] = deque()
        self.skip: set[int] = set()
        self.skip_first = (-1, 0)
        if resume is None:
            return
        stamps = resume.stamps or [None] * len(resume.items)
        seq, r = resume.first_seq, 0
        # A range of lines stays one entry (one chunk when re-sent).
        for k, (item, stamp) in enumerate([*zip(resume.items, stamps), (None, None)]):
            while r < len(ranges) and ranges[r][0] == k:
                lines = ranges[r][1]
                self.resume.append((seq, lines, None))
                seq += len(lines)
                r += 1
            if k < len(resume.items):
                self.resume.append((seq, item, stamp))
                seq += 1
        self.skip = set(resume.skip)
        self.skip_first = (resume.first_seq, resume.skip_outputs)
