"""One rank of ``tests/loader/test_central_modes_distributed.py``, launched by torchrun (gloo, CPU).

Usage: ``torchrun --nproc_per_node=2 ... tests/scripts/dist_modes.py OUT_DIR``

Each rank writes ``OUT_DIR/rank<r>.json``: its whole shard in each central
mode, the rest of the epoch resumed in each mode from a state taken after
``STEP`` items in each mode, the states' keys, what one rank resumed from the
ranks' merged state (``merge_states``) yields in each mode, and where its
service's socket directory was.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import attrs
import torch.distributed as dist

import centralpipe as cp
from tests.support.torchrun import rank_main

N = 41
STEP = 7
MODES = ("process", "service")


def square(x: int) -> int:
    return x * x


def plus_one(x: int) -> int:
    return x + 1


def make_pipe() -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(range(N))
        .shuffle(8)
        .map(square)
        .count("pre_shard")
        .shard(equalize="drop_last")
        .dispatch()
        .map(plus_one)
    )


def config(central: str) -> cp.LoaderConfig:
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=2, start_method="fork", buffer_size=8),
        distributed=cp.DistributedConfig.from_env(),
        central=central,
    )


def run_rank() -> dict[str, Any]:
    pipe = make_pipe()
    result: dict[str, Any] = {"full": {}, "resumed": {}, "merged": {}, "keys": {}}
    states: dict[str, Any] = {}
    for mode in MODES:
        with cp.Loader(pipe, config(mode)) as loader:
            if mode == "service":
                link = loader._central._link  # type: ignore[attr-defined]
                result["socket_dir"] = Path(link.path).parent.name
            result["full"][mode] = list(loader)
        with cp.Loader(pipe, config(mode)) as loader:
            it = iter(loader)
            result.setdefault("head", {})[mode] = [next(it) for _ in range(STEP)]
            states[mode] = loader.state_dict()
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, states[mode])
        result["keys"][mode] = sorted(states[mode])
        merged = cp.merge_states(gathered)
        one = cp.LoaderConfig(
            workers=cp.WorkerConfig(num_workers=0), distributed=cp.DistributedConfig()
        )
        with cp.Loader(pipe, attrs.evolve(one, central=mode)) as loader:
            loader.load_state_dict(merged)
            result["merged"][mode] = list(loader)
    for saved in MODES:
        for resumed in MODES:
            with cp.Loader(pipe, config(resumed)) as loader:
                loader.load_state_dict(states[saved])
                result["resumed"][f"{saved}-to-{resumed}"] = list(loader)
    return result


def main() -> int:
    out = Path(sys.argv[1])
    return rank_main(run_rank, out)


if __name__ == "__main__":
    sys.exit(main())
