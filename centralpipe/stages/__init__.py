"""Central stages: one ``torchdata.nodes.BaseNode`` per stage spec.

Importing this package imports every stage module, so that each kind's node
class is registered (``NODE_CLASSES``, see :class:`CentralNode`);
:func:`build_central` turns the central part of a plan into a chain of nodes
sharing one :class:`RunContext`; :mod:`centralpipe.stages.totals` says how
many items each stage yields per epoch when that is known without iterating.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from centralpipe.stages.base import (
    NODE_CLASSES,
    SOURCE_KEY,
    CentralNode,
    RunContext,
    add_stage_note,
    build_central,
)
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
    "Batch",
    "BucketByMaxTokens",
    "CentralNode",
    "Count",
    "DatasetSource",
    "FilesSource",
    "Filter",
    "FlatMap",
    "IterableSource",
    "Map",
    "Mix",
    "NodeSource",
    "Pack",
    "Parallel",
    "ReadJsonl",
    "ReadLines",
    "ReadParquet",
    "RunContext",
    "Shard",
    "Shuffle",
    "StatefulIterableSource",
    "add_stage_note",
    "all_nodes",
    "build_central",
]


def all_nodes(nodes: Sequence[CentralNode[Any]]) -> list[CentralNode[Any]]:
    """``nodes`` with the stages inside ``mix`` sources after their mix."""
    out: list[CentralNode[Any]] = []
    for node in nodes:
        out.append(node)
        if isinstance(node, Mix):
            out.extend(node.inner_nodes())
    return out
