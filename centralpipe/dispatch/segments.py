"""Fused segments: consecutive parallel stages run as one round trip.

With ``WorkerConfig(fuse_parallel=True)`` (the default) parallel stages that
follow one another directly (nothing central between them) form a
:class:`Segment`: one ordered stream whose tip is the first stage's source
and whose worker chain runs every stage's function in turn. The segment's
outputs are those of its last stage, which the stream is attached to; the
other stages are never pulled.

The checkpoint keeps one in-flight entry per stage: the segment's in-flight
inputs are its first stage's, and the later stages' entries are empty. So a
state saved fused resumes unfused as it is. A state saved unfused whose later
stages have inputs in flight resumes that pass unfused (the next pass fuses
again): the pass's output is the same either way.

What is fused: maps and filters (at most one output per input). A
``flat_map`` keeps its own stream: an input whose outputs were delivered in
part is in the checkpoint as the flat_map's input with the outputs to skip,
a value that a fused segment never has in the main process. A stage with
``with_rng=True`` starts a new segment, as its random stream is keyed by the
seq of its own inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from centralpipe.checkpoint.model import Checkpoint
from centralpipe.dispatch.worker.chain import WorkerChain
from centralpipe.stages import Parallel

__all__ = ["Segment", "plan_segments", "unfused_for"]


@attrs.frozen
class Segment:
    """Two or more parallel stages (indexes into the run's parallel stages,
    in chain order) run as one stream over ``chain`` (worker chain
    ``chain_id``)."""

    members: tuple[int, ...]
    chain: WorkerChain
    chain_id: int


def _joins(prev: Parallel, node: Parallel) -> bool:
    """``node`` can run in the same segment as ``prev``, just before it."""
    return (
        node.source is prev
        and prev.item_kind.outputs != "any"
        and node.item_kind.outputs != "any"
        and not node.spec.item_options.with_rng
    )


def plan_segments(
    nodes: Sequence[Parallel], seed: int, flat_arrays: bool, first_chain_id: int
) -> list[Segment]:
    """The segments of two or more stages among ``nodes`` (the parallel
    stages in chain order); their chains get ids from ``first_chain_id`` on."""
    groups: list[list[int]] = []
    for i, node in enumerate(nodes):
        if groups and _joins(nodes[groups[-1][-1]], node):
            groups[-1].append(i)
        else:
            groups.append([i])
    segments: list[Segment] = []
    for group in (g for g in groups if len(g) > 1):
        chain = WorkerChain([nodes[i].spec for i in group], seed, flat_arrays)
        segments.append(Segment(tuple(group), chain, first_chain_id + len(segments)))
    return segments


def unfused_for(segment: Segment, nodes: Sequence[Parallel], resume: Checkpoint | None) -> bool:
    """The pass resuming ``resume`` runs ``segment`` unfused: a later stage
    of it has inputs in flight (a state saved unfused)."""
    if resume is None:
        return False
    for i in segment.members[1:]:
        entry: Any = resume.in_flight.get(nodes[i].name)
        if entry is not None and (entry.items or entry.ranges or entry.skip_outputs):
            return True
    return False
