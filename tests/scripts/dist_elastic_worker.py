"""One rank of ``tests/loader/test_elastic_distributed.py``, launched by torchrun (gloo, CPU).

Usage: ``... tests/scripts/dist_elastic_worker.py OUT_DIR PHASE STEPS WORKERS``

For each ``equalize`` mode the rank builds the loader, loads
``OUT_DIR/<mode>-<PHASE - 1>.pt`` (the global state of the previous phase) if
there is one, takes ``STEPS`` steps (``-1``: to the end of the epoch), gathers
the global state with ``cp.gather_states`` and rank 0 saves it as
``OUT_DIR/<mode>-<PHASE>.pt``. In phase 0 it also saves with
``torch.distributed.checkpoint``: each rank's own state under a per-rank key,
the global state under one key, and — the mistake — each rank's own state under
one shared key, which must be refused on load with a message that says so; and
it gathers the state of a run whose feeder had read to the end of the epoch
(``OUT_DIR/<mode>-end.pt``).
Each rank writes what it saw to ``OUT_DIR/<PHASE>-rank<r>.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import centralpipe as cp
from tests.checkpoint.test_elastic import (
    pipe,
)  # the pipeline test_elastic_distributed compares with
from tests.support.torchrun import rank_main

EQUALIZE = ("drop_last", "pad")


def config(workers: int) -> cp.LoaderConfig:
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=workers, buffer_size=4, start_method="fork"),
        distributed=cp.DistributedConfig.from_env(),
    )


def feeder_at_end(equalize: str, out: Path) -> None:
    """3 steps with a feeder that has read to the end of the epoch (no
    workers: it pulls one chunk of 64 items, the whole epoch, at the first
    step); rank 0 saves the gathered state as ``OUT_DIR/<mode>-end.pt``."""
    workers = cp.WorkerConfig(num_workers=0, buffer_size=None, chunk_size=64)
    config = cp.LoaderConfig(workers=workers, distributed=cp.DistributedConfig.from_env())
    with cp.Loader(pipe(equalize), config) as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        assert loader.query("shard_5")["done"]
        merged = cp.gather_states(loader)
    if dist.get_rank() == 0:
        torch.save(merged, out / f"{equalize}-end.pt")


def dcp_recipes(equalize: str, loader: cp.Loader[Any], out: Path, workers: int) -> dict[str, Any]:
    """Save with torch.distributed.checkpoint three ways; load each back."""
    rank = dist.get_rank()
    own = loader.state_dict()
    glob = cp.gather_states(loader)
    dcp.save({f"loader_rank{rank}": own}, checkpoint_id=out / f"dcp-{equalize}-per-rank")
    dcp.save({"loader": glob}, checkpoint_id=out / f"dcp-{equalize}-global")
    dcp.save({"loader": own}, checkpoint_id=out / f"dcp-{equalize}-shared-key")
    result: dict[str, Any] = {}
    for kind, key in (("per-rank", f"loader_rank{rank}"), ("global", "loader")):
        with cp.Loader(pipe(equalize), config(workers)) as fresh:
            state = {key: fresh.state_dict()}
            dcp.load(state, checkpoint_id=out / f"dcp-{equalize}-{kind}")
            fresh.load_state_dict(state[key])
            result[kind] = list(fresh)
    with cp.Loader(pipe(equalize), config(workers)) as fresh:
        state = {"loader": fresh.state_dict()}
        dcp.load(state, checkpoint_id=out / f"dcp-{equalize}-shared-key")
        try:
            fresh.load_state_dict(state["loader"])
            result["shared-key"] = "loaded"
        except cp.CheckpointError as exc:
            result["shared-key"] = str(exc)
    return result


def run_rank(out: Path, phase: int, steps: int, workers: int) -> dict[str, Any]:
    result: dict[str, Any] = {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
    for equalize in EQUALIZE:
        with cp.Loader(pipe(equalize), config(workers)) as loader:
            if phase:
                previous = torch.load(out / f"{equalize}-{phase - 1}.pt", weights_only=True)
                loader.load_state_dict(previous)
            it = iter(loader)
            got = list(it) if steps < 0 else [next(it) for _ in range(steps)]
            merged = cp.gather_states(loader)
            to_zero = cp.gather_states(loader, dst=0)
            # The feeder may run ahead between the two calls: same position, not same dict.
            if dist.get_rank() == 0:
                assert to_zero is not None and to_zero["position"] == merged["position"]
            else:
                assert to_zero is None
            if dist.get_rank() == 0:
                torch.save(merged, out / f"{equalize}-{phase}.pt")
            result[equalize] = {"items": got, "position": merged["position"]}
            if phase == 0:
                result[equalize]["dcp"] = dcp_recipes(equalize, loader, out, workers)
        if phase == 0:
            feeder_at_end(equalize, out)
    return result


def main() -> int:
    out, phase, steps, workers = Path(sys.argv[1]), *map(int, sys.argv[2:5])
    return rank_main(lambda: run_rank(out, phase, steps, workers), out, prefix=f"{phase}-")


if __name__ == "__main__":
    sys.exit(main())
