"""Ranks of ``tests/loader/test_central_node_seed_distributed.py``: the seed pipeline
(``read_lines → map(tokenize, parallel=True) → bucket → count → shard →
dispatch → pad`` on the bundled corpus) in ``central="node"`` under torchrun.

Usage: ``python -m torch.distributed.run --nproc_per_node=N ... tests/scripts/dist_node_seed.py
OUT PHASE``, one launch per phase; batches are written as digests:

- ``compare`` (2 ranks): each rank's epoch in ``process`` and ``node`` mode
  at 0-3 workers; a state of each rank after ``STEP`` batches in node mode
  (``OUT/common-rank<r>.pt``), the merge of both resumed on one rank in
  process and in service mode; the error local rank 0 gets when local rank 1 stops reading;
- ``kill MODE`` (2 ranks, ``central=MODE``): both ranks save at ``STEP``
  (``OUT/kill-MODE-rank<r>.pt``), then local rank 1 kills itself with SIGKILL
  a few batches later; each rank writes the pids of its service(s) and of
  every worker it knew, and rank 0 what it saw;
- ``restart MODE`` (2 ranks): both ranks load their ``kill MODE`` states in
  that mode;
- ``three`` (3 ranks): every rank loads the merge of the ``compare`` states,
  in node, process and service mode.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import centralpipe as cp
from centralpipe.dispatch import node, timeouts
from examples.token_buckets import DATA_GLOB, build_pipeline, collate_pad, tokenize
from tests.support.torchrun import rank_main

#: Two of the bundled corpus's four files (about 3,000 lines): enough batches
#: per rank, at a third of the time of the whole corpus under torchrun.
SEED_GLOB = DATA_GLOB.replace("*.txt", "part-00[02].txt")

STEP = 9
#: Batches after STEP at which local rank 1 is killed.
KILL_AFTER = 4
STALL_S = 2.0
OUT = Path()
#: The central mode of the ``kill`` and ``restart`` phases (their third argument).
MODE = "node"


def small_buffer() -> cp.Pipeline:
    """The seed pipeline with a 64-line bucket buffer: states find the
    tokenizer's lines in flight."""
    return (
        cp.Pipeline.from_files(SEED_GLOB)
        .read_lines()
        .map(tokenize, parallel=True)
        .bucket_by_max_tokens(256, len_fn=len, buffer_size=64, min_len=1)
        .count("pre_shard", weight_fn=len)
        .shard(equalize="drop_last")
        .dispatch()
        .map(collate_pad)
    )


def config(central: str, workers: int = 2, rank: int | None = None) -> cp.LoaderConfig:
    distributed = cp.DistributedConfig.from_env()
    if rank is not None:  # one rank of a smaller job, in this process
        distributed = cp.DistributedConfig(rank=rank, world_size=1)
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=workers, start_method="fork", buffer_size=8),
        distributed=distributed,
        central=central,
    )


def digest(batch: torch.Tensor) -> str:
    """The batch's shape and bytes, in 16 hex digits."""
    h = hashlib.sha256(str(tuple(batch.shape)).encode())
    h.update(batch.numpy().tobytes())
    return h.hexdigest()[:16]


def digests(loader: Any) -> list[str]:
    return [digest(b) for b in loader]


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def compare() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {"full": {}}
    for workers in (2, 3):  # 0 and 1 are checked in one process (test_central_node)
        for mode in ("process", "node"):
            with cp.Loader(build_pipeline(SEED_GLOB, 1024), config(mode, workers)) as loader:
                out["full"][f"{mode}-{workers}"] = digests(loader)
    pipe = small_buffer()
    for mode in ("process", "node"):
        with cp.Loader(pipe, config(mode, 1)) as loader:
            out["full"][f"small-{mode}-1"] = digests(loader)
    with cp.Loader(pipe, config("node")) as loader:
        it = iter(loader)
        out["head"] = [digest(next(it)) for _ in range(STEP)]
        state = loader.state_dict()
    flight = state["in_flight"]["map_2"]
    out["tokenizer_in_flight"] = bool(flight["items"] or flight.get("ranges"))
    torch.save(state, OUT / f"common-rank{rank}.pt")
    dist.barrier()  # both states are on disk
    states = [torch.load(OUT / f"common-rank{r}.pt", weights_only=True) for r in range(2)]
    with cp.Loader(pipe, config("process", rank=0)) as loader:
        out["whole_epoch_one_rank"] = digests(loader)
        loader.load_state_dict(cp.merge_states(states))
        out["merged_rest_one_rank"] = digests(loader)
    with cp.Loader(pipe, config("service", rank=0)) as loader:
        loader.load_state_dict(cp.merge_states(states))
        out["merged_rest_one_rank_service"] = digests(loader)
    out["stalled"] = _stalled(pipe, rank)
    return out


def _stalled(pipe: cp.Pipeline, rank: int) -> Any:
    node.WINDOW_ITEMS, timeouts.STALL_TIMEOUT_S = 4, STALL_S  # the service forks with them
    with cp.Loader(pipe, config("node")) as loader:
        it = iter(loader)
        next(it)
        out: Any = "stopped reading"
        if rank == 0:
            started = time.monotonic()
            error = _error(lambda: [next(it) for _ in range(10_000)])
            out = [error, time.monotonic() - started]
        dist.barrier()
        return out


def kill() -> dict[str, Any]:
    rank, mode = dist.get_rank(), MODE
    loader = cp.Loader(small_buffer(), config(mode))
    it = iter(loader)
    head = [digest(next(it)) for _ in range(STEP)]
    torch.save(loader.state_dict(), OUT / f"kill-{mode}-rank{rank}.pt")
    pids = loader.worker_pids()
    service_pid = getattr(loader._central, "service_pid", None)
    if service_pid and service_pid not in pids:
        pids.append(service_pid)
    head_file = OUT / f"kill-{mode}-head-rank{rank}.json"
    head_file.write_text(json.dumps({"head": head, "pids": pids}))
    dist.barrier()  # both states are on disk
    for _ in range(KILL_AFTER):
        next(it)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    # node: an error naming rank 1; else the rank goes on alone (torchrun
    # stops it once it sees rank 1 gone).
    seen = _error(lambda: [next(it) for _ in range(10_000)])
    (OUT / f"kill-{mode}-seen-rank0.txt").write_text(seen)
    loader.close()
    return {"seen": seen}


def restart() -> dict[str, Any]:
    rank, mode = dist.get_rank(), MODE
    with cp.Loader(small_buffer(), config(mode)) as loader:
        loader.load_state_dict(torch.load(OUT / f"kill-{mode}-rank{rank}.pt", weights_only=True))
        rest = digests(loader)
    with cp.Loader(small_buffer(), config("process")) as loader:
        full = digests(loader)
    return {"rest": rest, "full": full}


def three() -> dict[str, Any]:
    states = [torch.load(OUT / f"common-rank{r}.pt", weights_only=True) for r in range(2)]
    merged = cp.merge_states(states)
    out: dict[str, Any] = {}
    for mode in ("node", "process", "service"):
        with cp.Loader(small_buffer(), config(mode)) as loader:
            loader.load_state_dict(merged)
            out[mode] = digests(loader)
    return out


def main() -> int:
    global OUT, MODE
    OUT = Path(sys.argv[1])
    phase = sys.argv[2]
    if len(sys.argv) > 3:
        MODE = sys.argv[3]
        phase_id = f"{phase}-{MODE}"
    else:
        phase_id = phase
    run = {"compare": compare, "kill": kill, "restart": restart, "three": three}[phase]
    return rank_main(run, OUT, prefix=f"{phase_id}-")


if __name__ == "__main__":
    sys.exit(main())
