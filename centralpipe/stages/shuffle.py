"""``shuffle``: a buffered shuffle seeded by ``(seed, epoch, stage name)``.

The buffer fills to ``buffer_size``; each output is a uniformly chosen buffered
item, replaced by the next source item. The checkpoint holds the buffer and the
generator state, so a resumed epoch continues the same permutation.

The index is drawn as ``random.Random.randrange`` draws it (``getrandbits``
of the buffer length's bit length, drawn again while too large), with each
draw stored in the state (``draw``) by the C call that makes it, and the
item leaves the buffer with no call between its removal and the return. A
Ctrl-C (``KeyboardInterrupt``) therefore finds the generator and its last
draw together, and the buffer whole: the next call uses that draw, and the
permutation is the uninterrupted one.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import attrs
from attrs import validators as v
from torchdata.nodes import BaseNode

from centralpipe.plan.options import ShuffleOptions
from centralpipe.plan.specs import StageSpec
from centralpipe.seeding import derive_seed
from centralpipe.stages.base import CentralNode, RunContext, Total, pull_one
from centralpipe.validators import FieldError, checked, int_in, sequence_of

__all__ = ["Shuffle", "ShuffleState"]

BUFFER_KEY = "buffer"
RNG_KEY = "rng"
DRAINING_KEY = "draining"
DRAW_KEY = "draw"


def _rng_state(value: Any) -> random.Random:
    version, internal, gauss = value
    rng = random.Random()
    rng.setstate((version, tuple(internal), gauss))
    return rng


def _valid_rng(_inst: Any, _attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise TypeError(value)
    if not isinstance(value[1], (list, tuple)) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in value[1]
    ):
        raise TypeError(value)
    _rng_state(value)  # raises ValueError/TypeError for a state random cannot take


@attrs.frozen(kw_only=True)
class ShuffleState:
    buffer: list[Any] = attrs.field(validator=checked(FieldError, "a list", sequence_of()))
    rng: list[Any] = attrs.field(
        validator=checked(FieldError, "a random.Random state [version, [ints], gauss]", _valid_rng)
    )
    draining: bool = attrs.field(validator=checked(FieldError, "a bool", v.instance_of(bool)))
    #: A draw made and not yet used (a call cut short by an interrupt): [r],
    #: else empty (and absent from the state).
    draw: list[int] = attrs.field(
        factory=list,
        validator=checked(
            FieldError,
            "[] or [one int >= 0] (a draw not yet used)",
            sequence_of(int_in(0)),
        ),
    )


class Shuffle(CentralNode[Any]):
    kind = "shuffle"
    State = ShuffleState

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> Shuffle:
        return cls(source, spec.options_as(ShuffleOptions).buffer_size, name=spec.name, ctx=ctx)

    def out_total(self, total: Total) -> Total | None:
        return total

    def __init__(
        self, source: BaseNode[Any], buffer_size: int, *, name: str, ctx: RunContext
    ) -> None:
        super().__init__(source, name=name, ctx=ctx)
        self._size = buffer_size
        self._buffer: list[Any] = []
        self._rng = random.Random(0)
        self._draining = False
        #: The draw not yet used: [r] or [] (see the module docstring).
        self._draw: list[int] = []

    def produce(self) -> Any:
        assert self.source is not None
        buf = self._buffer
        while not self._draining and len(buf) < self._size:
            try:
                pull_one(self.source, buf)
            except StopIteration:
                self._draining = True
        if not buf:
            raise StopIteration
        n = len(buf)
        k = n.bit_length()
        draw, bits = self._draw, (k,)
        while True:
            if not draw:
                # One C call draws and stores: no interrupt between the two.
                draw.extend(map(self._rng.getrandbits, bits))
            j = draw[-1]
            if j < n:
                break
            del draw[-1]  # too large: drawn again, as randrange does
        # From here to the return no call: the item leaves the buffer and the
        # draw is used up together.
        item = buf[j]
        buf[j] = buf[-1]
        del buf[-1]
        del draw[-1]
        return item

    def own_state(self) -> dict[str, Any]:
        version, internal, gauss = self._rng.getstate()
        state = {
            BUFFER_KEY: list(self._buffer),
            RNG_KEY: [version, list(internal), gauss],
            DRAINING_KEY: self._draining,
        }
        if self._draw:
            state[DRAW_KEY] = list(self._draw)
        return state

    def restore(self, state: dict[str, Any] | None) -> None:
        if state is None:
            self._buffer = []
            self._rng = random.Random(derive_seed(self.ctx.seed, self.ctx.epoch, self.name))
            self._draining = False
            self._draw = []
            return
        self._buffer = list(state[BUFFER_KEY])
        self._rng = _rng_state(state[RNG_KEY])
        self._draining = state[DRAINING_KEY]
        self._draw = [int(r) for r in state.get(DRAW_KEY, ())]

    def check_state(self, state: ShuffleState, states: Mapping[str, Any]) -> None:
        if len(state.buffer) > self._size:
            raise FieldError("buffer", f"at most buffer_size={self._size} items", state.buffer)
        if state.draw:
            # Drawn for the buffer as it is: getrandbits of its length's bits.
            bits = len(state.buffer).bit_length()
            if len(state.draw) > 1 or not state.buffer or state.draw[0] >= 1 << bits:
                expected = (
                    f"one int < 2**{bits} (drawn for the {len(state.buffer)} buffered items), "
                    "and only with items buffered"
                )
                raise FieldError("draw", expected, state.draw)

    def max_items_out(self, state: ShuffleState, bound_in: int | None) -> int | None:
        return bound_in

    def query_state(self) -> dict[str, Any]:
        return {"buffered": len(self._buffer), "draining": self._draining}
