"""Central stages: one ``torchdata.nodes.BaseNode`` per stage spec.

:func:`build_central` turns the central part of a plan into a chain of nodes
sharing one :class:`RunContext`; :mod:`centralpipe.stages.totals` says how many
items each stage yields per epoch when that is known without iterating.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from centralpipe.pipeline import StageSpec
from centralpipe.stages.base import SOURCE_KEY, CentralNode, RunContext, add_stage_note
from centralpipe.stages.batch import Batch, BucketByMaxTokens
from centralpipe.stages.count import Count
from centralpipe.stages.files import ReadLines
from centralpipe.stages.mix import Mix
from centralpipe.stages.pack import Pack
from centralpipe.stages.shard import Shard
from centralpipe.stages.shuffle import Shuffle
from centralpipe.stages.sources import DatasetSource, FilesSource, IterableSource, NodeSource
from centralpipe.stages.transform import Filter, FlatMap, Map

__all__ = [
    "NODE_CLASSES",
    "SOURCE_KEY",
    "CentralNode",
    "Count",
    "RunContext",
    "Shard",
    "add_stage_note",
    "all_nodes",
    "build_central",
]


#: The node class of each central stage kind (its ``State`` is the kind's state schema).
NODE_CLASSES: dict[str, type[CentralNode[Any]]] = {
    cls.kind: cls
    for cls in (
        IterableSource,
        DatasetSource,
        NodeSource,
        FilesSource,
        ReadLines,
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
    o, name = spec.options, spec.name
    if spec.kind == "iterable":
        return IterableSource(o["source"], o["mode"], name=name, ctx=ctx)
    if spec.kind == "dataset":
        return DatasetSource(o["source"], name=name, ctx=ctx)
    if spec.kind == "node":
        return NodeSource(o["source"], name=name, ctx=ctx)
    if spec.kind == "mix":
        return Mix(o["pipelines"], o["weights"], o["stop"], build_central, name=name, ctx=ctx)
    if spec.kind == "files":
        return FilesSource(glob=o.get("glob"), paths=o.get("paths"), name=name, ctx=ctx)
    assert source is not None
    if spec.kind == "read_lines":
        return ReadLines(source, encoding=o["encoding"], name=name, ctx=ctx)
    if spec.kind == "map":
        return Map(source, spec.fn, name=name, ctx=ctx)
    if spec.kind == "filter":
        return Filter(source, spec.fn, name=name, ctx=ctx)
    if spec.kind == "flat_map":
        return FlatMap(source, spec.fn, name=name, ctx=ctx)
    if spec.kind == "batch":
        return Batch(source, o["batch_size"], o["drop_last"], name=name, ctx=ctx)
    if spec.kind == "bucket_by_max_tokens":
        return BucketByMaxTokens(source, spec.fn, name=name, ctx=ctx, **o)
    if spec.kind == "pack":
        return Pack(source, spec.fn, name=name, ctx=ctx, **o)
    if spec.kind == "shuffle":
        return Shuffle(source, o["buffer_size"], name=name, ctx=ctx)
    if spec.kind == "count":
        return Count(source, spec.fn, name=name, ctx=ctx)
    if spec.kind == "shard":
        return Shard(source, o["equalize"], name=name, ctx=ctx)
    raise AssertionError(f"unknown central stage kind {spec.kind!r}")


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
