"""``mix``: a source that draws from several sub-pipelines by weight.

Each step draws a source with probability proportional to its weight, from a
``random.Random`` seeded by ``(seed, epoch, stage name)``, and yields that
source's next item. ``stop`` says what happens when a drawn source ends:

- ``"first_exhausted"``: the epoch ends;
- ``"all_exhausted"``: the source leaves the draw (the others' weights are
  renormalised); the epoch ends when every source with weight > 0 has ended;
- ``"never"``: the source starts its next *pass* (its stages reset, seeded by
  ``(seed, pass)`` so its shuffles differ per pass) and yields from it; the
  epoch never ends.

Naming: a sub-pipeline's stages keep their names, qualified by the mix and
the source: stage ``tok`` of source ``en`` in mix ``mix`` is ``mix/en/tok``,
for queries, metrics, errors and the checkpoint. Qualified names are unique
within the whole pipeline (the builder refuses a clash). The spec, its
checks and the qualified names are the builder's: :mod:`centralpipe.plan.mix`.

State: the sampler's generator, items drawn per source this epoch, each
source's pass, the ended sources, and every sub-pipeline's stage states
(``{"sources": {key: {qualified name: state}}}``). The weights are
configuration, not state: a checkpoint resumes under new weights, every source
at its position, the new weights applying from the next draw.

A draw whose ``next()`` was interrupted (Ctrl-C) stays drawn (``draw``, and
``restart`` while a source's next pass was being started): the next call
takes from the same source instead of drawing again, so the sampler's stream
and every source's passes are those of an uninterrupted run.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from attrs import validators as v

from centralpipe.errors import PipelineError
from centralpipe.plan.options import MixOptions
from centralpipe.plan.specs import STOP_MODES, Plan, StageSpec
from centralpipe.seeding import derive_seed
from centralpipe.stages.base import CentralNode, RunContext, build_central
from centralpipe.validators import FieldError, checked, int_in, sequence_of

__all__ = ["STOP_MODES", "Mix", "MixState"]

RNG_KEY = "rng"
DRAWN_KEY = "drawn"
PASSES_KEY = "passes"
EXHAUSTED_KEY = "exhausted"
DONE_KEY = "done"
STOP_KEY = "stop"
SOURCES_KEY = "sources"
DRAW_KEY = "draw"
RESTART_KEY = "restart"

Builder = Callable[[Sequence[StageSpec], RunContext], list[CentralNode[Any]]]
_COUNT = int_in(0, 2**63)


def _valid_rng(_inst: Any, _attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise TypeError(value)
    version, internal, gauss = value
    if not isinstance(internal, (list, tuple)) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in internal
    ):
        raise TypeError(value)
    random.Random().setstate((version, tuple(internal), gauss))  # raises if random cannot


def _counts(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(value)
    for count in value.values():
        _COUNT(_inst, attr, count)


@attrs.frozen(kw_only=True)
class MixState:
    """The sampler, per-source counts, and each source's stage states by name."""

    rng: list[Any] = attrs.field(
        validator=checked(FieldError, "a random.Random state [version, [ints], gauss]", _valid_rng)
    )
    drawn: dict[str, int] = attrs.field(
        validator=checked(FieldError, "a dict of source -> int >= 0", _counts)
    )
    passes: dict[str, int] = attrs.field(
        validator=checked(FieldError, "a dict of source -> int >= 0", _counts)
    )
    exhausted: list[str] = attrs.field(
        validator=checked(FieldError, "a list of source names", sequence_of(v.instance_of(str)))
    )
    done: bool = attrs.field(validator=checked(FieldError, "a bool", v.instance_of(bool)))
    stop: str = attrs.field(validator=checked(FieldError, "a stop mode", v.in_(STOP_MODES)))
    sources: dict[str, Any] = attrs.field(
        validator=checked(FieldError, "a dict of source -> stage states", v.instance_of(Mapping))
    )
    #: The source an interrupted call drew (``None``: none), and whether it
    #: was starting that source's next pass.
    draw: str | None = attrs.field(
        default=None,
        validator=checked(FieldError, "None or a source name", v.optional(v.instance_of(str))),
    )
    restart: bool = attrs.field(
        default=False, validator=checked(FieldError, "a bool", v.instance_of(bool))
    )

    def __attrs_post_init__(self) -> None:
        if self.restart and self.draw is None:
            raise FieldError("restart", "False when no source is drawn (draw is None)", True)


# -- the node ---------------------------------------------------------------------------


class Mix(CentralNode[Any]):
    kind = "mix"
    State = MixState

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> Mix:
        o = spec.options_as(MixOptions)
        return cls(o.pipelines, o.weights, o.stop, build_central, name=spec.name, ctx=ctx)

    def __init__(
        self,
        pipelines: Mapping[str, Plan],
        weights: Mapping[str, float],
        stop: str,
        build: Builder,
        *,
        name: str,
        ctx: RunContext,
    ) -> None:
        super().__init__(None, name=name, ctx=ctx)
        self._keys = list(pipelines)
        self._weights = [float(weights[k]) for k in self._keys]
        self._stop = stop
        self._ctxs = [
            RunContext(seed=ctx.seed, epoch=ctx.epoch, rank=ctx.rank, world_size=ctx.world_size)
            for _ in self._keys
        ]
        self._chains = [build(pipelines[k].stages, c) for k, c in zip(self._keys, self._ctxs)]
        for nodes in self._chains:
            for node in nodes:
                prepare = getattr(node, "prepare", None)
                if callable(prepare):
                    prepare()  # e.g. a glob matching nothing fails when the Loader starts
        self._tips = [nodes[-1] for nodes in self._chains]
        self._clear()

    def _clear(self) -> None:
        n = len(self._keys)
        self._rng = random.Random(derive_seed(self.ctx.seed, self.ctx.epoch, self.name))
        self._drawn = [0] * n
        self._passes = [0] * n
        self._exhausted = [False] * n
        self._done = False
        #: The source drawn by an interrupted call (-1: none); ``_restart``:
        #: that call was starting the source's next pass.
        self._draw = -1
        self._restart = False
        self._rebuild_draw()

    def _rebuild_draw(self) -> None:
        """The sources in the draw (weight > 0, not ended) and their cumulative weights."""
        self._active = [i for i, w in enumerate(self._weights) if w > 0 and not self._exhausted[i]]
        self._cum: list[float] = []
        total = 0.0
        for i in self._active:
            total += self._weights[i]
            self._cum.append(total)
        self._total = total

    def sources(self) -> list[tuple[str, float, list[CentralNode[Any]]]]:
        """``(key, weight, stage nodes)`` of each source, in order."""
        return list(zip(self._keys, self._weights, self._chains))

    def inner_nodes(self) -> list[CentralNode[Any]]:
        """Every stage node of the sub-pipelines, nested mixes expanded."""
        out: list[CentralNode[Any]] = []
        for nodes in self._chains:
            for node in nodes:
                out.append(node)
                if isinstance(node, Mix):
                    out.extend(node.inner_nodes())
        return out

    # -- iteration ------------------------------------------------------------------

    def produce(self) -> Any:
        tips = self._tips
        while True:
            i = self._draw
            if i < 0:
                active, cum = self._active, self._cum
                if self._done or not active:
                    self._done = True
                    raise StopIteration
                j = bisect.bisect_right(cum, self._rng.random() * self._total)
                i = active[j] if j < len(active) else active[-1]  # float rounding at the top
                # Kept until the item is taken: an interrupted call's draw stands.
                self._draw = i
            try:
                if self._restart:
                    item = self._next_pass(i)
                else:
                    try:
                        item = next(tips[i])
                    except StopIteration:
                        if self._stop == "first_exhausted":
                            self._done = True
                            self._draw = -1
                            raise
                        if self._stop == "all_exhausted":
                            self._exhausted[i] = True
                            self._rebuild_draw()
                            self._draw = -1
                            continue
                        self._restart = True
                        item = self._next_pass(i)
            except BaseException as exc:
                if isinstance(exc, Exception):  # a failure: the draw is used up
                    self._draw, self._restart = -1, False
                raise
            self._drawn[i] += 1
            self._draw = -1
            return item

    def _next_pass(self, i: int) -> Any:
        """Start source ``i``'s next pass (``_restart`` is set) and take its first item."""
        p = self._passes[i] + 1
        self._start_source(i, None, p)
        self._passes[i], self._restart = p, False
        try:
            return next(self._tips[i])
        except StopIteration:
            msg = (
                f"mix '{self.name}': source '{self._keys[i]}' yields no items in pass "
                f"{self._passes[i]}; stop='never' needs every source with weight > 0 to "
                "yield at least one item per pass."
            )
            raise PipelineError(msg) from None

    def _start_source(self, i: int, flat: dict[str, Any] | None, p: int | None = None) -> None:
        ctx = self._ctxs[i]
        ctx.epoch = self.ctx.epoch
        if p is None:
            p = self._passes[i]
        ctx.seed = self.ctx.seed if p == 0 else derive_seed(self.ctx.seed, "pass", p)
        self._tips[i].load_flat(flat)

    # -- state ------------------------------------------------------------------------

    def own_state(self) -> dict[str, Any]:
        version, internal, gauss = self._rng.getstate()
        keys = self._keys
        return {
            RNG_KEY: [version, list(internal), gauss],
            DRAWN_KEY: dict(zip(keys, self._drawn)),
            PASSES_KEY: dict(zip(keys, self._passes)),
            EXHAUSTED_KEY: [k for k, gone in zip(keys, self._exhausted) if gone],
            DONE_KEY: self._done,
            STOP_KEY: self._stop,
            SOURCES_KEY: {
                k: {node.name: node.own_state() for node in nodes}
                for k, nodes in zip(keys, self._chains)
            },
            DRAW_KEY: keys[self._draw] if self._draw >= 0 else None,
            RESTART_KEY: self._restart,
        }

    def restore(self, state: dict[str, Any] | None) -> None:
        self._clear()
        if state is None:
            for i in range(len(self._keys)):
                self._start_source(i, None)
            return
        version, internal, gauss = state[RNG_KEY]
        self._rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
        exhausted = set(state[EXHAUSTED_KEY])
        for i, key in enumerate(self._keys):
            self._drawn[i] = int(state[DRAWN_KEY][key])
            self._passes[i] = int(state[PASSES_KEY][key])
            self._exhausted[i] = key in exhausted
            self._start_source(i, dict(state[SOURCES_KEY][key]))
        self._done = bool(state[DONE_KEY])
        draw = state.get(DRAW_KEY)
        self._draw = -1 if draw is None else self._keys.index(draw)
        self._restart = bool(state.get(RESTART_KEY, False))
        self._rebuild_draw()

    def check_state(self, state: MixState, states: Mapping[str, Any]) -> None:
        from centralpipe import checkpoint  # the model checks each inner stage too

        if state.stop != self._stop:
            raise FieldError("stop", f"{self._stop!r} (this pipeline's stop mode)", state.stop)
        keys = sorted(self._keys)
        for field in (DRAWN_KEY, PASSES_KEY, SOURCES_KEY):
            if sorted(getattr(state, field)) != keys:
                raise FieldError(
                    field, f"keyed by this mix's sources {keys}", getattr(state, field)
                )
        if not set(state.exhausted) <= set(keys):
            raise FieldError(EXHAUSTED_KEY, f"a list of sources from {keys}", state.exhausted)
        if state.draw is not None and (state.draw not in keys or state.draw in state.exhausted):
            raise FieldError(DRAW_KEY, f"None or a source in the draw, from {keys}", state.draw)
        if state.restart and self._stop != "never":
            raise FieldError(RESTART_KEY, "False (only stop='never' starts passes)", True)
        for key, nodes in zip(self._keys, self._chains):
            flat = state.sources[key]
            names = [node.name for node in nodes]
            if not isinstance(flat, Mapping) or sorted(flat) != sorted(names):
                got = sorted(flat) if isinstance(flat, Mapping) else flat
                raise FieldError(f"sources['{key}']", f"the states of stages {names}", got)
            inner: dict[str, Any] = {}
            for node in nodes:
                cls = node.State
                raw = flat[node.name]
                inner[node.name] = (
                    raw if cls is None else checkpoint.structure_state(raw, cls, node.name)
                )
            for node in nodes:
                try:
                    node.check_state(inner[node.name], inner)
                except FieldError as exc:
                    field = f"sources['{key}']['{node.name}'].{exc.field}"
                    raise FieldError(field, exc.expected, exc.value) from None

    def max_items_out(self, state: MixState, bound_in: int | None) -> int | None:
        return sum(state.drawn.values())

    def query_state(self) -> dict[str, Any]:
        keys = self._keys
        return {
            DRAWN_KEY: dict(zip(keys, self._drawn)),
            PASSES_KEY: dict(zip(keys, self._passes)),
            EXHAUSTED_KEY: [k for k, gone in zip(keys, self._exhausted) if gone],
            "weights": dict(zip(keys, self._weights)),
            STOP_KEY: self._stop,
            DONE_KEY: self._done,
        }

    # -- metrics and lifetime -----------------------------------------------------------

    def source_busy_ns(self) -> int:
        return sum(tip.busy_ns for tip in self._tips)

    def source_items(self) -> int | None:
        return sum(tip.items_out for tip in self._tips)

    def release(self) -> None:
        for tip in self._tips:
            tip.release()
        super().release()
