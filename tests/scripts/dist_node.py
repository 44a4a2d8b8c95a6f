"""One rank of ``tests/loader/test_central_node_distributed.py``, launched by torchrun (gloo, CPU).

Usage: ``torchrun --nproc_per_node=2 ... tests/scripts/dist_node.py OUT_DIR``

Both local ranks share one ``central="node"`` service per Loader. Each rank
writes ``OUT_DIR/rank<r>.json``: its whole shard in ``process`` and ``node``
mode, the rest of the epoch resumed in each mode from a state taken after
``STEP`` items in each mode (and what ``query()`` and ``metrics()`` answered
then; and from the ``gather_states`` global state of
each mode, in node mode), the ranks' merged states resumed on one rank,
and the errors each rank saw when the service was killed, when the other
local rank's client was killed, and when the other local rank stopped
reading; which of the service and its workers outlived the Loaders'
close; and ``OUT_DIR/node-state-rank<r>.pt``, its node-mode state.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import centralpipe as cp
from centralpipe.dispatch import node, nodeservice, timeouts
from centralpipe.dispatch.worker.loop import main_alive
from tests.scripts.dist_modes import make_pipe, plus_one, square
from tests.support.torchrun import rank_main

N = 41
STEP = 7
MODES = ("process", "node")
#: Small, so that a rank that stops reading stops the other within the test
#: (the service, forked when local rank 0 builds its Loader, takes both).
node.WINDOW_ITEMS = 4
#: The stall test's; the other checks keep the default.
STALL_S = 2.0
OUT = Path()


def config(central: str) -> cp.LoaderConfig:
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=2, start_method="fork", buffer_size=8),
        distributed=cp.DistributedConfig.from_env(),
        central=central,
    )


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def run_rank() -> dict[str, Any]:
    pipe = make_pipe()
    rank = dist.get_rank()
    result: dict[str, Any] = {"full": {}, "head": {}, "resumed": {}, "merged": {}, "queries": {}}
    states: dict[str, Any] = {}
    for mode in MODES:
        with cp.Loader(pipe, config(mode)) as loader:
            result["full"][mode] = [list(loader), list(loader)]
            if mode == "node":
                central: Any = loader._central
                pids = [central.service_pid, *loader.worker_pids()]
        if mode == "node":
            result["left_alive"] = _alive_after(pids, 10.0)
        with cp.Loader(pipe, config(mode)) as loader:
            it = iter(loader)
            result["head"][mode] = [next(it) for _ in range(STEP)]
            result["queries"][mode] = {
                "live": loader.query("pre_shard"),
                "delivered": loader.query("pre_shard", delivered=True),
                "source": sorted(loader.query("source")),
                "metrics": sorted(loader.metrics()),
            }
            states[mode] = loader.state_dict()
            gathered_state = cp.gather_states(loader)
        with cp.Loader(pipe, config("node")) as loader:  # every local rank loads the same
            loader.load_state_dict(gathered_state)
            result.setdefault("gathered", {})[mode] = list(loader)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, states[mode])
        one = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=0))
        with cp.Loader(pipe, one) as loader:
            loader.load_state_dict(cp.merge_states(gathered))
            result["merged"][mode] = list(loader)
    torch.save(states["node"], OUT / f"node-state-rank{rank}.pt")
    result["equalize"] = {}
    for equalize in (None, "pad"):
        for mode in MODES:
            with cp.Loader(_pipe(equalize), config(mode)) as loader:
                result["equalize"].setdefault(str(equalize), {})[mode] = list(loader)
    for saved in MODES:
        for resumed in MODES:
            with cp.Loader(pipe, config(resumed)) as loader:
                loader.load_state_dict(states[saved])
                result["resumed"][f"{saved}-to-{resumed}"] = list(loader)
    result["service_killed"] = _service_killed(pipe, rank)
    result["rank_killed"] = _rank_killed(pipe, rank)
    result["stalled"] = _stalled(pipe, rank)
    return result


def _pipe(equalize: str | None) -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(range(N))
        .shuffle(8)
        .map(square)
        .count("pre_shard")
        .shard(equalize=equalize)
        .dispatch()
        .map(plus_one)
    )


def _alive_after(pids: list[int], within_s: float) -> list[int]:
    """Which of ``pids`` still live (zombies count as gone) ``within_s`` after now."""
    deadline = time.monotonic() + within_s
    while True:
        alive = [p for p in pids if main_alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _service_killed(pipe: cp.Pipeline, rank: int) -> str:
    with cp.Loader(pipe, config("node")) as loader:
        it = iter(loader)
        next(it)
        dist.barrier()
        if rank == 0:
            os.kill(loader._central.service_pid, signal.SIGKILL)  # type: ignore[attr-defined]
        dist.barrier()
        return _error(lambda: [next(it) for _ in range(N)])


def _client(pipe: cp.Pipeline, ready: Any) -> None:
    loader = cp.Loader(pipe, config("node"))
    it = iter(loader)
    next(it)
    ready.send(True)
    time.sleep(60)  # killed here


def _rank_killed(pipe: cp.Pipeline, rank: int) -> str:
    """Local rank 1's Loader lives in a child process, killed with SIGKILL."""
    if rank == 1:
        ctx = multiprocessing.get_context("fork")
        r, w = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_client, args=(pipe, w))
        child.start()
        next(nodeservice._IDS)  # the child's Loader took this process's next node id
        ok = r.poll(60)
        dist.barrier()
        child.kill()
        child.join(10)
        dist.barrier()
        return f"child ready {ok}, exit {child.exitcode}"
    with cp.Loader(pipe, config("node")) as loader:
        it = iter(loader)
        next(it)
        dist.barrier()
        dist.barrier()
        time.sleep(0.5)
        return _error(lambda: [next(it) for _ in range(N)])


def _stalled(pipe: cp.Pipeline, rank: int) -> str:
    timeouts.STALL_TIMEOUT_S = STALL_S
    with cp.Loader(pipe, config("node")) as loader:
        it = iter(loader)
        next(it)
        if rank == 0:
            out = _error(lambda: [next(it) for _ in range(N)])
        dist.barrier()
        return out if rank == 0 else "stopped reading"


def main() -> int:
    global OUT
    OUT = Path(sys.argv[1])
    return rank_main(run_rank, OUT)


if __name__ == "__main__":
    sys.exit(main())
