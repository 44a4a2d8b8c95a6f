"""``Loader.metrics()``: counters read without any wait.

Every value is a plain attribute read (stage counters, stream statistics,
the run's bookkeeping), taken without a lock: ``metrics()`` never waits for
the central chain or a worker, and each value is exact as of its read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from centralpipe.config import WorkerConfig
from centralpipe.dispatch.executors.pool import Executor
from centralpipe.dispatch.reorder import StreamStats
from centralpipe.dispatch.run import Run
from centralpipe.stages import CentralNode, all_nodes

__all__ = ["collect"]


def collect(
    nodes: Sequence[CentralNode[Any]],
    stats: StreamStats,
    segment_stats: Mapping[str, StreamStats],
    workers: WorkerConfig,
    run: Run | None,
    pool: Executor | None,
) -> dict[str, Any]:
    """Per central stage items in/out and own time; ``"dispatch"``: buffer,
    skipped items, worker restarts, items per worker and waiting times."""
    out: dict[str, Any] = {}
    in_flight = run.segment_in_flight() if run is not None else {}
    for node in all_nodes(nodes):
        # A stage fused into a later one is never pulled: its count (and the
        # next stage's input count) is None rather than a wrong 0.
        fused = getattr(node, "fused_into", None) is not None
        fed_fused = getattr(node.source, "fused_into", None) is not None
        out[node.name] = {
            "items_in": None if fed_fused else node.source_items(),
            "items_out": None if fused else node.items_out,
            "time_s": node.own_time_s(),
        }
        if node.name in segment_stats:
            seg = segment_stats[node.name]
            out[node.name]["parallel"] = {
                "in_flight": in_flight.get(node.name, 0),
                "chunk_size": seg.chunk_size,
                "skipped": seg.skipped,
                "items_per_worker": list(seg.items_per_worker),
                "lines_read_in_workers": seg.range_lines,
            }
    s, w = stats, workers
    in_chunk = run.delivered_in_chunk() if run is not None else 0
    out["dispatch"] = {
        "num_workers": w.num_workers,
        "dispatched": s.dispatched,
        "delivered": s.delivered + in_chunk,
        "buffered": max(0, run.in_flight - in_chunk) if run is not None else 0,
        "buffer_size": w.buffer_size,
        "buffer_high_water": s.high_water,
        "buffered_bytes": run.held_bytes() if run is not None else 0,
        "buffer_bytes": run.held_limit(w.buffer_bytes) if run is not None else w.buffer_bytes,
        "buffered_bytes_high_water": s.bytes_high_water,
        "chunk_size": s.chunk_size,
        "skipped": s.skipped + sum(seg.skipped for seg in segment_stats.values()),
        "restarts": s.restarts,
        "items_per_worker": list(s.items_per_worker),
        "inline_items": s.inline_items,
        "wait_workers_s": s.wait_workers_s,
        "wait_central_s": s.wait_central_s,
    }
    transport = pool.transport_bytes() if pool is not None else None
    if transport is not None:
        out["dispatch"]["transport"] = transport
    return out
