"""One rank of ``tests/loader/test_distributed.py``, launched by torchrun (gloo, CPU).

Usage: ``torchrun --nproc_per_node=2 ... tests/scripts/dist_worker.py OUT_DIR``

Each rank writes ``OUT_DIR/rank<r>.json``: its rank as the process group and
``DistributedConfig.from_env()`` see it, its shard of the central stream for
each ``equalize`` mode, the pre-shard count after a full pass, and whether a
checkpoint taken at the same step on every rank resumed exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import centralpipe as cp
from tests.support.torchrun import rank_main

N = 101  # odd, so the last round is incomplete on 2 ranks
WORKERS = 2
CHECKPOINT_STEPS = (0, 7, 25)
EQUALIZE = (None, "drop_last", "pad")


def square(x: int) -> int:
    return x * x


def plus_one(x: int) -> int:
    return x + 1


def make_pipe(equalize: str | None) -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(range(N))
        .shuffle(16)
        .map(square)
        .count("pre_shard")
        .shard(equalize=equalize)
        .dispatch()
        .map(plus_one)
    )


def run_rank(out_dir: Path) -> dict[str, Any]:
    config = cp.DistributedConfig.from_env()
    result: dict[str, Any] = {
        "group": [dist.get_rank(), dist.get_world_size()],
        "from_env": [config.rank, config.world_size],
        "shards": {},
        "pre_shard": {},
        "resume": {},
    }
    loader_config = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=WORKERS, buffer_size=8), distributed=config
    )
    for equalize in EQUALIZE:
        key = str(equalize)
        pipe = make_pipe(equalize)
        with cp.Loader(pipe, loader_config) as loader:
            full = list(loader)
            result["shards"][key] = full
            result["pre_shard"][key] = loader.query("pre_shard", delivered=True)
        checks = {}
        for k in CHECKPOINT_STEPS:
            path = out_dir / f"ckpt-{key}-{k}.rank{config.rank}.pt"
            with cp.Loader(pipe, loader_config) as loader:
                it = iter(loader)
                head = [next(it) for _ in range(k)]
                torch.save(loader.state_dict(), path)
            with cp.Loader(pipe, loader_config) as loader:
                loader.load_state_dict(torch.load(path, weights_only=True))
                tail = list(loader)
            checks[str(k)] = head + tail == full
        result["resume"][key] = checks
    return result


def main() -> int:
    out = Path(sys.argv[1])
    return rank_main(lambda: run_rank(out), out)


if __name__ == "__main__":
    sys.exit(main())
