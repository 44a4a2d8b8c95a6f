"""Central stages: one ``torchdata.nodes.BaseNode`` per stage spec.

:func:`build_central` turns the central part of a plan into a chain of nodes
sharing one :class:`RunContext`; :func:`central_length` says how many items the
chain yields per epoch when that is known without iterating.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from centralpipe.pipeline import StageSpec
from centralpipe.stages.base import SOURCE_KEY, CentralNode, RunContext, add_stage_note
from centralpipe.stages.batch import Batch, BucketByMaxTokens
from centralpipe.stages.count import Count
from centralpipe.stages.files import ReadLines
from centralpipe.stages.pack import Pack
from centralpipe.stages.shard import Shard, shard_length
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
    "build_central",
    "central_length",
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


def central_length(
    nodes: Sequence[CentralNode[Any]], specs: Sequence[StageSpec], ctx: RunContext
) -> int | None:
    """Items the chain yields per epoch, or ``None`` when only iterating would tell."""
    n: int | None = None
    for node, spec in zip(nodes, specs):
        kind = spec.kind
        if kind in ("iterable", "dataset", "files"):
            n = node.length()
        elif kind in ("map", "count", "shuffle"):
            pass
        elif kind == "batch":
            size, drop = spec.options["batch_size"], spec.options["drop_last"]
            n = None if n is None else (n // size if drop else -(-n // size))
        elif kind == "shard":
            n = (
                None
                if n is None
                else shard_length(n, spec.options["equalize"], ctx.rank, ctx.world_size)
            )
        else:
            n = None
        if n is None and kind not in ("iterable", "dataset", "files"):
            return None
    return n
