"""The ``stages`` section of ``python -m centralpipe bench``: main-process cost
per item of the stateful central stages ``mix`` and ``pack``.

A stage's cost is measured as the time to drain the central chain with the
stage minus the time to drain the same chain without it (best of
``REPEATS`` each, interleaved), divided by the items the stage handled. The
chains are drained directly (no Loader, no workers), which is exactly the work
the feeder does in the main process.
"""

from __future__ import annotations

import gc
import random
import time
from typing import Any

import centralpipe as cp
from centralpipe.stages import RunContext, build_central

__all__ = ["MIX_TARGET_S", "PACK_TARGET_S", "measure", "report_lines", "targets"]

REPEATS = 3
MIX_ITEMS = 300_000
PACK_ITEMS = 100_000
PACK_MAX_TOKENS = 2048
PACK_BUFFER = 10_000
#: Targets per item, in the main process.
MIX_TARGET_S = 2e-6
PACK_TARGET_S = 20e-6


def _drain_s(pipe: cp.Pipeline) -> tuple[float, int]:
    """Seconds to drain the central chain of ``pipe`` once, and its items out."""
    nodes = build_central(pipe.central_stages, RunContext())
    tip = nodes[-1]
    tip.load_flat(None)
    nxt = tip.next
    n = 0
    gc.disable()
    try:
        start = time.perf_counter()
        try:
            while True:
                nxt()
                n += 1
        except StopIteration:
            pass
        return time.perf_counter() - start, n
    finally:
        gc.enable()
        tip.release()


def _stage_cost_s(with_stage: cp.Pipeline, without: list[cp.Pipeline], items: int) -> float:
    """(drain time with the stage - drain time of ``without``) / ``items``, best of each."""
    best_with = best_without = float("inf")
    for _ in range(REPEATS):
        best_with = min(best_with, _drain_s(with_stage)[0])
        best_without = min(best_without, sum(_drain_s(p)[0] for p in without))
    return max(0.0, best_with - best_without) / items


def measure(scale: int = 1) -> dict[str, Any]:
    """Per-item costs of ``mix`` (3 sources) and ``pack`` (both strategies)."""
    out: dict[str, Any] = {}
    per_source = MIX_ITEMS // scale // 3
    sources = {k: cp.Pipeline.from_iterable(range(per_source)) for k in ("a", "b", "c")}
    mixed = cp.Pipeline.mix(sources, {"a": 0.5, "b": 0.3, "c": 0.2})
    out["mix"] = {
        "items": 3 * per_source,
        "cost_s": _stage_cost_s(mixed, list(sources.values()), 3 * per_source),
        "what": "Pipeline.mix of 3 from_iterable(range(...)) sources, weights 0.5/0.3/0.2",
    }
    n = PACK_ITEMS // scale
    rng = random.Random(0)
    items = [range(rng.randint(1, 1024)) for _ in range(n)]  # len() in C, no token lists
    source = cp.Pipeline.from_iterable(items)
    for strategy in ("best_fit", "first_fit"):
        packed = source.pack(PACK_MAX_TOKENS, strategy=strategy, buffer_size=PACK_BUFFER)
        out[f"pack_{strategy}"] = {
            "items": n,
            "cost_s": _stage_cost_s(packed, [source], n),
            "what": f"pack({PACK_MAX_TOKENS}, strategy={strategy!r}, buffer_size={PACK_BUFFER:_}) "
            "of lengths uniform in 1..1024",
        }
    return out


def report_lines(stages: dict[str, Any]) -> list[str]:
    if not stages:
        return []
    lines = [
        "",
        "## Central stages (main-process cost per item)",
        "",
        "Time to drain the central chain with the stage minus without it, per item "
        f"(best of {REPEATS}, no workers).",
        "",
        "| stage | items | µs per item |",
        "|---|--:|--:|",
    ]
    for key in ("mix", "pack_best_fit", "pack_first_fit"):
        r = stages[key]
        lines.append(f"| {r['what']} | {r['items']:,} | {r['cost_s'] * 1e6:.2f} |")
    return lines


def targets(stages: dict[str, Any]) -> list[tuple[str, str, bool]]:
    if not stages:
        return []
    mix, pack = stages["mix"]["cost_s"], stages["pack_best_fit"]["cost_s"]
    return [
        ("mix of 3 sources: < 2 µs per item", f"{mix * 1e6:.2f} µs", mix < MIX_TARGET_S),
        (
            f"pack(buffer_size={PACK_BUFFER:_}), best_fit: < 20 µs per item",
            f"{pack * 1e6:.2f} µs",
            pack < PACK_TARGET_S,
        ),
    ]
