"""Stamps: the totals of the ``count`` and ``shard`` stages carried by each
dispatched item, so that ``query(name, delivered=True)`` and a checkpoint's
``delivered_stamp`` are exact as of the last item the consumer received,
however far the central chain runs ahead.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from centralpipe.stages import CentralNode, Shard

__all__ = ["Stamper"]


class Stamper:
    """Totals of the ``count``/``shard`` stages up to a point of the central
    chain, as of the last item that left that point: a stream stamps each item
    it pulls with it, so ``query(name, delivered=True)`` is exact.

    Stages before a parallel stage are read through that stage's stream (as
    of the input of its last output), the others live.
    """

    def __init__(self, nodes: Sequence[CentralNode[Any]]) -> None:
        last = max((i for i, n in enumerate(nodes) if getattr(n, "parallel", False)), default=-1)
        self.segment: Any = nodes[last] if last >= 0 else None
        self.live = [n for n in nodes[last + 1 :] if n.stamped]
        below = self.segment.stamper.stamped if self.segment is not None else []
        #: Every stamped stage up to this point, in chain order.
        self.stamped: list[CentralNode[Any]] = [*below, *self.live]
        # A count before a shard is read through the shard: the totals as the
        # item reached it (after an elastic resume its queued items carry their own).
        self._getters: list[Any] = []
        shards: list[Any] = [n for n in self.live if isinstance(n, Shard)]
        for n in self.live:
            if isinstance(n, Shard):
                self._getters.append(n.stamp)
                continue
            owner = next((sh for sh in shards if n in sh.counts), None)
            if owner is None:
                self._getters.append(n.totals)
            else:
                self._getters.append(functools.partial(owner.count_stamp, owner.counts.index(n)))

    def __call__(self) -> Any:
        if not self.stamped:
            return None
        live = tuple(get() for get in self._getters)
        if self.segment is None or not self.segment.stamper.stamped:
            return live
        return tuple(self.segment.out_stamp()) + live
