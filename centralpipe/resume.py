"""Checkpoint bodies and where a pass resumes: the Loader's plumbing for
``state_dict()`` and ``load_state_dict()``.

:func:`assemble` turns what a run captured (or :func:`idle_body`, between
runs) into the checkpoint dict; :func:`plans` turns a loaded checkpoint's
in-flight entries into one :class:`~centralpipe.dispatch.boundary.StreamPlan`
per stream. The checkpoint's layout and its checks live in
:mod:`centralpipe.checkpoint`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from centralpipe import checkpoint
from centralpipe.checkpoint import FORMAT_VERSION, compact
from centralpipe.dispatch.boundary import StreamPlan, empty_segment_entry
from centralpipe.dispatch.wire.protocol import InFlight
from centralpipe.plan.pipeline import WORKER_KINDS, Pipeline
from centralpipe.stages import CentralNode, Parallel, RunContext, Shard
from centralpipe.stages.totals import chain_totals

__all__ = [
    "assemble",
    "copy_state",
    "delivered",
    "expected",
    "idle_body",
    "plans",
    "readers",
    "skipped",
    "tuplify",
]


def idle_body(segments: Sequence[str], nodes: Sequence[CentralNode[Any]]) -> dict[str, Any]:
    """What a run would capture, between runs: no item in flight."""
    return {
        "segments": {name: empty_segment_entry() for name in segments},
        "central": {node.name: node.own_state() for node in nodes},
        "next_seq": 0,
        "in_flight": {
            "first_seq": 0,
            "items": [],
            "stamps": None,
            "skip_outputs": 0,
            "skip": [],
        },
        "delivered_stamp": None,
        "finished": True,
        "delivered": 0,
        "skipped": 0,
    }


def assemble(
    body: dict[str, Any],
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
    stamp = body["delivered_stamp"]
    return {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "seed": seed,
        "epoch": epoch,
        "finished": body["finished"],
        # "merged" is always present, so a state_dict() used as the template
        # of torch.distributed.checkpoint's load receives a global state's flag.
        "distributed": {"rank": rank, "world_size": world_size, "merged": False},
        "central": body["central"],
        "in_flight": {
            **body["segments"],
            boundary: {
                "next_seq": body["next_seq"],
                **body["in_flight"],
                "delivered_stamp": None,  # the top-level one
            },
        },
        "delivered_stamp": stamp,
        "position": {
            "pre_shard_index": _pre_shard_index(stamped, stamp),
            "delivered": body["delivered"],
            "skipped": body["skipped"],
        },
    }


def expected(
    pipe: Pipeline,
    nodes: Sequence[CentralNode[Any]],
    ctx: RunContext,
    *,
    seed: int,
    rank: int,
    world_size: int,
    boundary: str,
) -> checkpoint.Expected:
    """What a checkpoint loaded into this pipeline must match
    (:func:`centralpipe.checkpoint.check_pipeline`)."""
    segments = [n for n in nodes if isinstance(n, Parallel)]
    return checkpoint.Expected(
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


def plans(
    resume: dict[str, Any], boundary: str, readers: dict[str, Any] | None = None
) -> dict[str, StreamPlan]:
    """Where each stream resumes, from a (checked) checkpoint; in-flight byte
    ranges become ranges of their in-flight lines, read by ``readers``."""
    readers = readers or {}
    out = {name: _plan(flight, readers.get(name)) for name, flight in resume["in_flight"].items()}
    out[boundary].delivered_stamp = tuplify(resume.get("delivered_stamp"))
    return out


def delivered(resume: dict[str, Any]) -> int:
    """Outputs the checkpoint's epoch had delivered (its step count)."""
    return int((resume.get("position") or {}).get("delivered") or 0)


def skipped(resume: dict[str, Any], boundary: str) -> int:
    """Inputs of the checkpoint's epoch that gave no output (``position.skipped``).

    A state from before that field has none: the first undelivered input's seq
    less the outputs delivered stands in, which is the count whenever each
    input gives at most one output (the only pipelines whose step count is
    checked against it)."""
    position = resume.get("position") or {}
    if position.get("skipped") is not None:
        return int(position["skipped"])
    first_seq = int(resume["in_flight"][boundary]["first_seq"])
    return max(0, first_seq - delivered(resume))


def _plan(flight: dict[str, Any], reader: Any) -> StreamPlan:
    records = flight.get("ranges") or ()
    # check_pipeline refused ranges for a stage that reads none.
    ranges = [reader.resumed_range(r) for r in records] if records else []
    resume = InFlight(
        flight["first_seq"],
        compact.decode_items(flight["items"]),
        None if flight.get("stamps") is None else list(flight["stamps"]),
        flight["skip_outputs"],
        flight["skip"],
        ranges,
    )
    return StreamPlan(flight["next_seq"], resume, tuplify(flight.get("delivered_stamp")))


def tuplify(stamp: Any) -> Any:
    if stamp is None:
        return None
    return tuple(tuple(x) if isinstance(x, list) else x for x in stamp)


def copy_state(sd: Any) -> dict[str, Any]:
    """A copy of the checkpoint's containers (items themselves are shared)."""
    out = dict(sd)
    out["in_flight"] = {name: _copy_flight(flight) for name, flight in sd["in_flight"].items()}
    out["central"] = dict(sd["central"])
    return out


def _copy_flight(flight: dict[str, Any]) -> dict[str, Any]:
    out = {**flight, "items": compact.copy_items(flight["items"])}
    if "ranges" in flight:
        out["ranges"] = [list(r) for r in flight["ranges"]]
    return out
