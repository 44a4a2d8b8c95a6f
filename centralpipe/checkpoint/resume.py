"""Checkpoints in and out of a Loader: what ``state_dict()`` writes and what a
loaded checkpoint resumes.

:func:`assemble` turns what a run captured (a
:class:`~centralpipe.checkpoint.model.Captured`, or :func:`idle` between runs)
into the checkpoint dict. :func:`load` checks a wire dict and keeps it as a
:class:`Pending` resume: its typed :class:`~centralpipe.checkpoint.Checkpoint`
is what the next pass resumes from (each stream is handed its
:class:`~centralpipe.checkpoint.Boundary`), and its wire dict is what
``state_dict()`` returns until then. :func:`expected` is what a checkpoint
must match to load into a pipeline. The layout itself is
:mod:`centralpipe.checkpoint.model`'s alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from centralpipe.checkpoint.fit import Expected
from centralpipe.checkpoint.model import Captured, Checkpoint, copy_wire, structure
from centralpipe.plan.pipeline import WORKER_KINDS, Pipeline
from centralpipe.stages import CentralNode, Parallel, RunContext, Shard
from centralpipe.stages.totals import chain_totals

__all__ = ["Pending", "assemble", "expected", "idle", "pending", "readers"]


@attrs.frozen
class Pending:
    """A checkpoint loaded and not yet resumed."""

    #: What the next pass resumes from.
    ckpt: Checkpoint
    #: The dict as loaded (its containers copied): ``state_dict()`` until then.
    wire: dict[str, Any]

    def state(self) -> dict[str, Any]:
        """``state_dict()`` while this is pending: the loaded dict (a copy)."""
        return copy_wire(self.wire)


def pending(sd: Mapping[str, Any], ckpt: Checkpoint | None = None) -> Pending:
    """``sd`` (already structured as ``ckpt``, else structured here) as a
    pending resume; later changes to ``sd``'s containers do not reach it."""
    wire = copy_wire(sd)
    if ckpt is None:
        return Pending(structure(wire), wire)
    # Its own dict of central states, as the wire copy has (the rest is the model's own).
    return Pending(attrs.evolve(ckpt, central=dict(ckpt.central)), wire)


def idle(segments: Sequence[str], nodes: Sequence[CentralNode[Any]]) -> Captured:
    """What a run would capture, between runs: no item in flight."""
    return Captured.idle(segments, {node.name: node.own_state() for node in nodes})


def assemble(
    body: Captured,
    *,
    fingerprint: Any,
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    boundary: str,
    stamped: Sequence[CentralNode[Any]],
) -> dict[str, Any]:
    """The checkpoint dict (builtins and tensors only) of a captured body."""
    return body.wire(
        fingerprint=fingerprint,
        seed=seed,
        epoch=epoch,
        rank=rank,
        world_size=world_size,
        boundary=boundary,
        pre_shard_index=_pre_shard_index(stamped, body.delivered_stamp),
    )


def expected(
    pipe: Pipeline,
    nodes: Sequence[CentralNode[Any]],
    ctx: RunContext,
    *,
    seed: int,
    rank: int,
    world_size: int,
    boundary: str,
) -> Expected:
    """What a checkpoint loaded into this pipeline must match
    (:func:`centralpipe.checkpoint.check_pipeline`)."""
    segments = [n for n in nodes if isinstance(n, Parallel)]
    return Expected(
        fingerprint=pipe.fingerprint(),
        seed=seed,
        rank=rank,
        world_size=world_size,
        nodes=list(nodes),
        boundaries=[*(n.name for n in segments), boundary],
        tip=boundary,
        segments={
            n.name: ([m for m in n.chain()[:-1] if m.stamped], n.kind == "flat_map")
            for n in segments
        },
        readers=readers(nodes),
        stamped=[n for n in nodes if n.stamped],
        multi_output=any(WORKER_KINDS[s.kind].outputs == "any" for s in pipe.worker_stages),
        length=_central_bound(pipe, nodes, ctx),
    )


def _central_bound(
    pipe: Pipeline, nodes: Sequence[CentralNode[Any]], ctx: RunContext
) -> int | None:
    """At most how many items the central chain yields per epoch (files are
    not read: a load must not count a corpus's lines)."""
    specs = pipe.central_stages
    total = chain_totals(nodes, specs, ctx, count_files=False)[specs[-1].name]
    return None if total is None else total.items


def _pre_shard_index(stamped: Sequence[CentralNode[Any]], stamp: Any) -> int | None:
    for i, node in enumerate(stamped):
        if isinstance(node, Shard):
            if stamp is None:
                return node.index
            entry = stamp[i]
            return int(entry[0] if isinstance(entry, (list, tuple)) else entry)
    return None


def readers(nodes: Sequence[CentralNode[Any]]) -> dict[str, Any]:
    """The stage each parallel stage can pull byte ranges of lines from
    (``read_lines``: ``take_range``), by the parallel stage's name."""
    return {
        n.name: n.source
        for n in nodes
        if isinstance(n, Parallel) and callable(getattr(n.source, "take_range", None))
    }
