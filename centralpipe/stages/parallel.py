"""A parallel central stage: ``map``/``filter``/``flat_map(..., parallel=True)``.

The stage sits in the central chain like any other, but its function runs on
the workers: the items it pulls from its source are numbered, sent
round-robin and their outputs come back *in order*
(:mod:`centralpipe.dispatch`), so every stage after it sees exactly the
stream it would see with the function run inline. Its own state is empty; the
inputs sent but not yet passed on are the checkpoint's in-flight inputs of
this stage (keyed by its name), re-sent on resume. Reading straight from
``read_lines`` on workers, its inputs go out as byte ranges of the files
that the workers read (:mod:`centralpipe.dispatch.worker.ranges`), and stay
ranges in the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torchdata.nodes import BaseNode

from centralpipe.plan.kinds import Total
from centralpipe.plan.specs import StageSpec
from centralpipe.stages.base import CentralNode, NoState, RunContext

__all__ = ["Parallel"]


class Parallel(CentralNode[Any]):
    """See the module docstring. The Loader attaches a stream at each run.

    The node of every ``parallel=True`` spec (made by its kind's node class,
    :mod:`centralpipe.stages.transform`); its length rule is its kind's
    (``item_kind``)."""

    #: Marks the stages whose outputs come from an ordered stream.
    parallel = True
    State = NoState

    def __init__(
        self, source: BaseNode[Any], spec: StageSpec, *, name: str, ctx: RunContext
    ) -> None:
        super().__init__(source, name=name, ctx=ctx)
        self.kind = spec.kind
        self.item_kind = spec.item_kind
        self.spec = spec
        #: Totals of the count/shard stages before this one (set by the Loader).
        self.stamper: Any = None
        self.stream: Any = None
        #: The later stage of a fused segment whose stream runs this stage's
        #: function (``dispatch.segments``; set at each run): this stage is
        #: never pulled, so its own output count is not known.
        self.fused_into: str | None = None
        self._outputs: Iterator[Any] | None = None

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> Parallel:
        return cls(source, spec, name=spec.name, ctx=ctx)

    def out_total(self, total: Total) -> Total | None:
        return self.item_kind.out_total(total, self.name)

    def max_items_out(self, state: Any, bound_in: int | None) -> int | None:
        return self.item_kind.max_items_out(bound_in)

    def attach(self, stream: Any) -> None:
        """Take outputs from ``stream`` (a new one at each run)."""
        self.stream = stream
        self._outputs = stream.outputs()

    def produce(self) -> Any:
        if self._outputs is None:  # pragma: no cover - the Loader always attaches
            raise RuntimeError(f"parallel stage '{self.name}' has no stream attached.")
        # A direct call of the Python-level __next__: the builtin next()
        # could drop the output to a Ctrl-C handled as it returns.
        return self._outputs.__next__()

    def produce_into(self, out: list[Any], n: int) -> None:
        # The rest of the current chunk in one slice; the first output of
        # each chunk (and every output of a chunk with failures) one by one
        # through the stream's ordered delivery.
        if self.stream.take_plain(out, n):
            return
        out.append(self.produce())

    def out_stamp(self) -> Any:
        """Stamp of the stages before this one as of its last output."""
        if self.stream is None:
            return self.stamper() or ()
        return self.stream.last_output_stamp() or ()
