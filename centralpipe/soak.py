"""``python -m centralpipe soak --minutes N``: a long randomized fault run.

Round after round it builds a loader with a random worker count, buffer and
chunk size, kills workers from outside and from inside worker stages, makes
worker stages raise (skipped with ``on_error="skip"``), checkpoints at random
points, closes loaders mid-epoch and resumes in fresh ones with another worker
count. Every epoch's delivered items are compared with an uninterrupted
single-process run: items lost and duplicated must both be 0. At the end it
prints the totals and the open file descriptors and child processes before
and after.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import centralpipe as cp

__all__ = ["main"]

#: Items whose chaos stage raises (deterministically): skipped, not lost.
RAISE_MOD, RAISE_AT = 97, 13


def unbatch(batch: list[int]) -> list[int]:
    return batch


def chaos(x: int, *, main_pid: int, marker_dir: str, kill_mod: int) -> int:
    """Raise on some items always; kill the worker on others, once each."""
    if x % RAISE_MOD == RAISE_AT:
        raise RuntimeError(f"soak: planned failure on {x}")
    if os.getpid() != main_pid and kill_mod and x % kill_mod == 0:
        marker = os.path.join(marker_dir, str(x))
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return x
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def _pipeline(n: int, shuffle: int, batch: int, fn: Any) -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(range(n))
        .shuffle(shuffle)
        .count("seen")
        .batch(batch)
        .dispatch()
        .flat_map(unbatch)
        .map(fn)
    )


def _open_fds() -> dict[int, str]:
    """This process's open file descriptors and what each one points at."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return fds


def _settled_fds(before: dict[int, str], wait_s: float = 5.0) -> dict[int, str]:
    """The open fds once collectable loaders are gone, waiting a bounded time.

    Reader and reaper threads of closed loaders may still be closing their
    pipes, and a loader caught in a reference cycle holds its fds until the
    cycle collector runs: neither is a leak, so collect and give them a
    moment before counting.
    """
    deadline = time.monotonic() + wait_s
    while True:
        gc.collect()
        fds = _open_fds()
        if len(fds) <= len(before) or time.monotonic() >= deadline:
            return fds
        time.sleep(0.1)


def _children() -> list[int]:
    import psutil

    out = []
    for child in psutil.Process().children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        if "forkserver" not in cmd and "resource_tracker" not in cmd:
            out.append(child.pid)
    return out


class Totals:
    def __init__(self) -> None:
        self.rounds = self.delivered = self.lost = self.duplicated = self.misordered = 0
        self.restarts = self.skipped = self.resumes = self.outside_kills = self.closed_mid_epoch = 0


def _config(rng: random.Random, workers: int) -> cp.LoaderConfig:
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(
            num_workers=workers,
            buffer_size=rng.choice([1, 8, 64, 1024, None]),
            chunk_size=rng.choice([None, 1, 4, 32]),
            start_method=rng.choice(["fork", "fork", "fork", "forkserver"]) if workers else None,
            on_error="skip",
            max_restarts=1000,
            item_retries=3,  # an outside kill may hit an input the chaos stage also kills
        ),
        seed=rng.randrange(1000),
    )


def _one_round(rng: random.Random, totals: Totals, tmp: Path) -> None:
    n = rng.randrange(200, 3000)
    shuffle, batch = rng.randrange(1, 64), rng.randrange(1, 9)
    marker_dir = tempfile.mkdtemp(dir=tmp)
    fn = functools.partial(
        chaos, main_pid=os.getpid(), marker_dir=marker_dir, kill_mod=rng.choice([0, 101, 333])
    )
    pipe = _pipeline(n, shuffle, batch, fn)
    first = _config(rng, rng.choice([1, 2, 3]))
    reference_cfg = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=0, on_error="skip"), seed=first.seed
    )
    ref: cp.Loader[int]
    with cp.Loader(pipe, reference_cfg) as ref:
        expected: list[int] = list(ref)
    got: list[int] = []
    cfg = first
    state: dict[str, Any] | None = None
    while True:
        loader: cp.Loader[int]
        with cp.Loader(pipe, cfg) as loader:
            if state is not None:
                loader.load_state_dict(state)
                totals.resumes += 1
            stop_at = rng.choice([None, rng.randrange(0, max(1, len(expected) - len(got)) + 1)])
            kill_at = rng.randrange(0, 200) if cfg.workers.num_workers else -1
            it: Iterator[int] = iter(loader)
            finished = True
            for i, x in enumerate(it):
                got.append(x)
                if i == kill_at and loader.worker_pids():
                    os.kill(rng.choice(loader.worker_pids()), signal.SIGKILL)
                    totals.outside_kills += 1
                if stop_at is not None and i + 1 >= stop_at:
                    finished = False
                    break
            state = loader.state_dict()
            m = loader.metrics()["dispatch"]
            totals.restarts += m["restarts"]
            totals.skipped += m["skipped"]
            if not finished:
                totals.closed_mid_epoch += 1
        if finished:
            break
        cfg = _config(rng, rng.choice([0, 1, 2, 3]))
        cfg = cp.LoaderConfig(workers=cfg.workers, seed=first.seed)
    totals.rounds += 1
    totals.delivered += len(got)
    want, have = Counter(expected), Counter(got)
    totals.lost += sum((want - have).values())
    totals.duplicated += sum((have - want).values())
    totals.misordered += int(got != expected and want == have)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m centralpipe soak", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to run (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.getLogger("centralpipe").setLevel(
        logging.ERROR if not os.environ.get("SOAK_VERBOSE") else logging.WARNING
    )
    rng = random.Random(args.seed)
    totals = Totals()
    # Start the forkserver (and resource tracker) first: they live for the
    # whole process and are not leaks.
    loader: cp.Loader[Any]
    warm = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=1, start_method="forkserver"))
    with cp.Loader(cp.Pipeline.from_iterable(range(3)).dispatch().map(unbatch), warm) as loader:
        list(loader)
    gc.collect()
    fds_before, children_before = _open_fds(), len(_children())
    deadline = time.monotonic() + args.minutes * 60
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        while time.monotonic() < deadline:
            _one_round(rng, totals, Path(tmp))
    fds_after = _settled_fds(fds_before)
    children_after = len(_children())
    elapsed = time.monotonic() - started
    print(f"soak: {elapsed / 60:.1f} min, {totals.rounds} epochs, seed {args.seed}")
    print(f"  items delivered : {totals.delivered}")
    print(f"  items lost      : {totals.lost}")
    print(f"  duplicates      : {totals.duplicated}")
    print(f"  wrong order     : {totals.misordered} epochs")
    print(f"  worker restarts : {totals.restarts} ({totals.outside_kills} kills from outside)")
    print(f"  skipped (raised): {totals.skipped}")
    print(
        f"  resumes         : {totals.resumes} ({totals.closed_mid_epoch} loaders closed mid-epoch)"
    )
    print(f"  open fds        : {len(fds_before)} before, {len(fds_after)} after")
    for fd in sorted(set(fds_after) - set(fds_before)):
        print(f"    new fd {fd} -> {fds_after[fd]}")
    print(f"  child processes : {children_before} before, {children_after} after")
    ok = (
        totals.lost == 0
        and totals.duplicated == 0
        and totals.misordered == 0
        and len(fds_after) <= len(fds_before)
        and children_after <= children_before
    )
    print("soak: PASS" if ok else "soak: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
