"""``shuffle``: a buffered shuffle seeded by ``(seed, epoch, stage name)``.

The buffer fills to ``buffer_size``; each output is a uniformly chosen buffered
item, replaced by the next source item. The checkpoint holds the buffer and the
generator state, so a resumed epoch continues the same permutation.
"""

from __future__ import annotations

import random
from typing import Any

from torchdata.nodes import BaseNode

from centralpipe.seeding import derive_seed
from centralpipe.stages.base import CentralNode, RunContext

__all__ = ["Shuffle"]

BUFFER_KEY = "buffer"
RNG_KEY = "rng"
DRAINING_KEY = "draining"


class Shuffle(CentralNode[Any]):
    kind = "shuffle"

    def __init__(
        self, source: BaseNode[Any], buffer_size: int, *, name: str, ctx: RunContext
    ) -> None:
        super().__init__(source, name=name, ctx=ctx)
        self._size = buffer_size
        self._buffer: list[Any] = []
        self._rng = random.Random(0)
        self._draining = False

    def produce(self) -> Any:
        assert self.source is not None
        buf = self._buffer
        while not self._draining and len(buf) < self._size:
            try:
                buf.append(next(self.source))
            except StopIteration:
                self._draining = True
        if not buf:
            raise StopIteration
        j = self._rng.randrange(len(buf))
        buf[j], buf[-1] = buf[-1], buf[j]
        return buf.pop()

    def own_state(self) -> dict[str, Any]:
        version, internal, gauss = self._rng.getstate()
        return {
            BUFFER_KEY: list(self._buffer),
            RNG_KEY: [version, list(internal), gauss],
            DRAINING_KEY: self._draining,
        }

    def restore(self, state: dict[str, Any] | None) -> None:
        if state is None:
            self._buffer = []
            self._rng = random.Random(derive_seed(self.ctx.seed, self.ctx.epoch, self.name))
            self._draining = False
            return
        self._buffer = list(state[BUFFER_KEY])
        version, internal, gauss = state[RNG_KEY]
        self._rng = random.Random()
        self._rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
        self._draining = bool(state[DRAINING_KEY])

    def query_state(self) -> dict[str, Any]:
        return {"buffered": len(self._buffer), "draining": self._draining}
