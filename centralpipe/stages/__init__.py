"""Central stages: one ``torchdata.nodes.BaseNode`` per stage spec.

:func:`build_central` turns the central part of a plan into a chain of nodes
sharing one :class:`RunContext`; :mod:`centralpipe.stages.totals` says how many
items each stage yields per epoch when that is known without iterating.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from centralpipe.plan.pipeline import StageSpec
from centralpipe.stages.base import SOURCE_KEY, CentralNode, RunContext, add_stage_note
from centralpipe.stages.batch import Batch, BucketByMaxTokens
from centralpipe.stages.count import Count
from centralpipe.stages.files import ReadLines
from centralpipe.stages.jsonl import ReadJsonl
from centralpipe.stages.mix import Mix
from centralpipe.stages.pack import Pack
from centralpipe.stages.parallel import Parallel
from centralpipe.stages.parquet import ReadParquet
from centralpipe.stages.shard import Shard
from centralpipe.stages.shuffle import Shuffle
from centralpipe.stages.sources import DatasetSource, FilesSource, IterableSource, NodeSource
from centralpipe.stages.stateful import StatefulIterableSource
from centralpipe.stages.transform import Filter, FlatMap, Map

__all__ = [
    "NODE_CLASSES",
    "SOURCE_KEY",
    "CentralNode",
    "Count",
    "Parallel",
    "RunContext",
    "Shard",
    "add_stage_note",
    "all_nodes",
    "build_central",
]


#: The node class of each central stage kind: the one home of the kind (how a
#: spec becomes a node, its state schema, its length rule); see ``CentralNode``.
NODE_CLASSES: dict[str, type[CentralNode[Any]]] = {
    cls.kind: cls
    for cls in (
        IterableSource,
        DatasetSource,
        NodeSource,
        StatefulIterableSource,
        FilesSource,
        ReadLines,
        ReadJsonl,
        ReadParquet,
        Map,
        Filter,
        FlatMap,
        Batch,
        BucketByMaxTokens,
        Shuffle,
        Count,
        Shard,
        Mix,
        Pack,
    )
}


def _build_one(
    spec: StageSpec, source: CentralNode[Any] | None, ctx: RunContext
) -> CentralNode[Any]:
    if spec.options.get("parallel"):
        assert source is not None
        return Parallel.from_spec(spec, source, ctx)
    cls = NODE_CLASSES.get(spec.kind)
    if cls is None:  # pragma: no cover - the builder makes only known kinds
        raise AssertionError(f"no node class for central stage kind {spec.kind!r}")
    return cls.from_spec(spec, source, ctx)


def build_central(specs: Sequence[StageSpec], ctx: RunContext) -> list[CentralNode[Any]]:
    """Nodes for the source and central stages, in order (last = the tip)."""
    nodes: list[CentralNode[Any]] = []
    for spec in specs:
        nodes.append(_build_one(spec, nodes[-1] if nodes else None, ctx))
    return nodes


def all_nodes(nodes: Sequence[CentralNode[Any]]) -> list[CentralNode[Any]]:
    """``nodes`` with the stages inside ``mix`` sources after their mix."""
    out: list[CentralNode[Any]] = []
    for node in nodes:
        out.append(node)
        if isinstance(node, Mix):
            out.extend(node.inner_nodes())
    return out
