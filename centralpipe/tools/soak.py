"""``python -m centralpipe soak --minutes N [--epochs E]``: a long randomized fault run.

Round after round it builds a loader over a random pipeline (``batch``,
``bucket_by_max_tokens`` or ``pack`` groups, sometimes a central map and
filter and a parallel map) with a random worker count, buffer (in items and
in bytes) and chunk size, kills workers from outside and from inside
worker stages, makes worker stages raise (skipped with ``on_error="skip"``),
checkpoints at random points, closes loaders mid-epoch and resumes in fresh
ones with another worker count. On top of that, seeded from ``--seed``
(:mod:`centralpipe.testing.faults`):

- ``KeyboardInterrupt`` lands at a random point inside ``next()`` (often the
  first, which starts the workers), ``state_dict()`` and ``close()``. After
  one in ``next()`` the same iterator goes on with exactly the remaining
  items (half the time), or the checkpoint taken then must resume exactly
  after the last item delivered; after one in ``state_dict()`` the iterator
  goes on; after one in ``close()`` a second ``close()`` must end every
  worker.
- Damaged copies of checkpoints are loaded into fresh loaders, into loaders
  with a good checkpoint pending and into loaders mid-iteration: each must
  raise ``CheckpointError`` and leave the loader as it was.

The worker stages' functions live in :mod:`centralpipe.tools.soak_stages`,
which imports neither torch nor the library, so a worker that replaces a
killed one starts in milliseconds.

Every epoch's delivered items are compared with an uninterrupted
single-process run: items lost and duplicated must both be 0. It runs for
``--minutes``, or until ``--epochs`` rounds are done if that comes first (a
fixed amount of work, as the test uses). The summary counts the kills made
from outside and from inside (one marker file per kill) and the interrupts
that landed and missed in each place, so a run whose faults stopped landing
shows it. A round that
takes longer than ``ROUND_TIMEOUT_S`` is a hang: every thread's stack is
printed and the run ends. At the end it prints the totals, every problem
found, and the open file descriptors, child processes and threads before and
after.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import gc
import logging
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import centralpipe as cp
from centralpipe.testing import faults
from centralpipe.tools.soak_stages import chaos, keep, same, size, unbatch

__all__ = ["main"]

#: Chance, per loader, of an interrupt in one ``next()`` (30 % of them in the
#: first, which starts the workers), in ``state_dict()`` and in ``close()``.
P_INTERRUPT_ITER, P_INTERRUPT_STATE, P_INTERRUPT_CLOSE = 0.5, 0.5, 0.5
#: Chance that the same iterator goes on after an interrupt in ``next()``
#: (else the loader is checkpointed and closed).
P_CONTINUE = 0.5
#: Interrupts in a ``next()`` after the first land within this many events.
LATER_NEXT_EVENTS = 30
#: Chance, per loader, of loading damaged checkpoints (fresh, pending, live).
P_DAMAGE = 0.5
#: A round (one epoch over several loaders) longer than this is a hang.
ROUND_TIMEOUT_S = 300.0
#: How long the workers of a closed loader may take to be gone.
CLOSE_WAIT_S = 10.0
#: Problems listed in the summary, at most.
MAX_PROBLEMS = 20


def _pipeline(n: int, shuffle: int, batch: int, fn: Any, rng: random.Random) -> cp.Pipeline:
    """The round's pipeline: a source, a shuffle and a count, then groups of
    items made by ``batch``, ``bucket_by_max_tokens`` or ``pack`` (the stages
    that gather several inputs per call), sometimes after a central map and
    filter and a parallel map, all of whose calls an interrupt can cut short;
    the worker stages ungroup the items and run ``fn``."""
    p = cp.Pipeline.from_iterable(range(n))
    if rng.random() < 0.3:
        p = p.map(same, parallel=True, name="par")
    p = p.shuffle(shuffle)
    if rng.random() < 0.5:
        p = p.map(same).filter(keep)
    p = p.count("seen", weight_fn=size if rng.random() < 0.5 else None)
    group = rng.choice(["batch", "batch", "bucket", "pack"])
    if group == "bucket":
        p = p.bucket_by_max_tokens(4 * batch, len_fn=size, buffer_size=shuffle)
    elif group == "pack":
        p = p.pack(4 * batch + 5, len_fn=size, buffer_size=shuffle)
    else:
        p = p.batch(batch)
    return p.dispatch().flat_map(unbatch).map(fn)


def _open_fds() -> dict[int, str]:
    """This process's open file descriptors and what each one points at."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return fds


def _is_heap_arena(target: str) -> bool:
    """An arena of multiprocessing's allocator for shared ctypes (the workers'
    status arrays): a deleted ``pym-<pid>-*`` file, held twice (its fd and its
    mmap). The allocator keeps arenas under 4 MiB for reuse for the life of
    the process (``multiprocessing.heap.Heap``), and makes a new one whenever
    more arrays are alive at once than before (loaders not yet collected, a
    busier test before): a high-water mark of the stdlib, not a leak."""
    return os.path.basename(target).startswith(f"pym-{os.getpid()}-")


def _leaked_fds(before: dict[int, str], after: dict[int, str]) -> list[int]:
    """New fds, other than multiprocessing's heap arenas."""
    return [fd for fd in sorted(set(after) - set(before)) if not _is_heap_arena(after[fd])]


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
        if not _leaked_fds(before, fds) or time.monotonic() >= deadline:
            return fds
        time.sleep(0.1)


def _threads() -> set[str]:
    """Names (with ids) of this process's centralpipe threads."""
    return {
        f"{t.name}#{t.ident}" for t in threading.enumerate() if t.name.startswith("centralpipe")
    }


def _settled_threads(before: set[str], wait_s: float = 5.0) -> set[str]:
    """Centralpipe threads once closed loaders' threads had a bounded time to end."""
    deadline = time.monotonic() + wait_s
    while True:
        now = _threads()
        if now <= before or time.monotonic() >= deadline:
            return now
        time.sleep(0.1)


def _children() -> list[int]:
    """Live descendants, workers under the forkserver included, except the
    forkserver and resource tracker themselves (they live for the process)."""
    import psutil

    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            helper = child.ppid() == os.getpid() and any(
                name in " ".join(child.cmdline()) for name in ("forkserver", "resource_tracker")
            )
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        if not helper:
            out.append(child.pid)
    return out


class Totals:
    def __init__(self) -> None:
        self.rounds = self.delivered = self.lost = self.duplicated = self.misordered = 0
        self.restarts = self.skipped = self.resumes = self.closed_mid_epoch = 0
        self.outside_kills = 0  # workers the soak SIGKILLed from the main process
        self.inside_kills = 0  # workers whose chaos stage SIGKILLed itself
        self.continued = 0  # iterators that went on after an interrupt in next()
        self.refused: Counter[str] = Counter()  # damaged checkpoints, by kind of defect
        self.leaked_workers = 0
        self.problems: list[str] = []

    def problem(self, text: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)


def _config(rng: random.Random, workers: int) -> cp.LoaderConfig:
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(
            num_workers=workers,
            buffer_size=rng.choice([1, 8, 64, 1024, None]),
            buffer_bytes=rng.choice([None, 1, 4096, 2**20]) if workers else None,
            chunk_size=rng.choice([None, 1, 4, 32]),
            start_method=rng.choice(["fork", "fork", "fork", "forkserver"]) if workers else None,
            on_error="skip",
            max_restarts=1000,
            item_retries=3,  # an outside kill may hit an input the chaos stage also kills
        ),
        seed=rng.randrange(1000),
    )


def _refuse_damaged(
    loader: cp.Loader[Any], good: dict[str, Any], rng: random.Random, totals: Totals, live: bool
) -> None:
    """Load damaged copies of ``good``: each must raise ``CheckpointError`` and
    (for a loader not iterating, whose state cannot move) change nothing."""
    before = None if live else loader.state_dict()
    for _ in range(rng.randint(1, 3)):
        bad, what = faults.damage(good, rng)
        try:
            loader.load_state_dict(bad)
        except cp.CheckpointError:
            totals.refused[what.split()[0]] += 1
            continue
        except Exception as exc:
            totals.problem(f"damaged checkpoint ({what}) raised {type(exc).__name__}: {exc}")
            continue
        totals.problem(f"damaged checkpoint accepted: {what}")
    if before is not None and loader.state_dict() != before:
        totals.problem("a refused load_state_dict changed the loader's state_dict()")


def _state(loader: cp.Loader[Any], inject: faults.Interrupts, rng: random.Random) -> Any:
    """``state_dict()``, maybe interrupted first (then taken again)."""
    if rng.random() < P_INTERRUPT_STATE:
        try:
            return inject.call("state_dict", loader.state_dict)
        except KeyboardInterrupt:
            pass
    return loader.state_dict()


def _close(
    loader: cp.Loader[Any],
    inject: faults.Interrupts,
    rng: random.Random,
    pids: set[int],
    totals: Totals,
) -> None:
    """``close()``, maybe interrupted (then closed again); its workers must be gone."""
    if rng.random() < P_INTERRUPT_CLOSE:
        try:
            inject.call("close", loader.close)
        except KeyboardInterrupt:
            pass
    loader.close()
    if loader.worker_pids():
        totals.problem(f"worker_pids() after close(): {loader.worker_pids()}")
    deadline = time.monotonic() + CLOSE_WAIT_S
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if _running(pid)}
        if alive:
            time.sleep(0.01)
    if alive:
        totals.leaked_workers += len(alive)
        totals.problem(f"workers {sorted(alive)} still running {CLOSE_WAIT_S} s after close()")


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _one_round(rng: random.Random, totals: Totals, tmp: Path, inject: faults.Interrupts) -> None:
    n = rng.randrange(200, 3000)
    shuffle, batch = rng.randrange(1, 64), rng.randrange(1, 9)
    marker_dir = tempfile.mkdtemp(dir=tmp)
    fn = functools.partial(
        chaos, main_pid=os.getpid(), marker_dir=marker_dir, kill_mod=rng.choice([0, 101, 333])
    )
    pipe = _pipeline(n, shuffle, batch, fn, rng)
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
        loader: cp.Loader[int] = cp.Loader(pipe, cfg)
        pids: set[int] = set()
        finished = False
        try:
            if state is not None:
                if rng.random() < P_DAMAGE:
                    _refuse_damaged(loader, state, rng, totals, live=False)
                loader.load_state_dict(state)
                totals.resumes += 1
                if rng.random() < P_DAMAGE:  # with a good checkpoint pending
                    _refuse_damaged(loader, state, rng, totals, live=False)
            left = max(1, len(expected) - len(got))
            stop_at = rng.choice([None, rng.randrange(0, left + 1)])
            kill_at = rng.randrange(0, 200) if cfg.workers.num_workers else -1
            interrupt_at = -1
            if rng.random() < P_INTERRUPT_ITER:
                interrupt_at = 0 if rng.random() < 0.3 else rng.randrange(0, left + 1)
            damage_at = rng.randrange(0, left + 1) if rng.random() < P_DAMAGE else -1
            probe_at = rng.randrange(0, left + 1) if rng.random() < P_INTERRUPT_STATE else -1
            it: Iterator[int] = iter(loader)
            i = 0
            while stop_at is None or i < stop_at:
                try:
                    if i == interrupt_at:
                        # The first next() starts the pass (thousands of
                        # events); a later one runs a few dozen.
                        reach = faults.MAX_EVENTS if i == 0 else LATER_NEXT_EVENTS
                        x = inject.call("iter", functools.partial(next, it), reach)
                    else:
                        x = next(it)
                except StopIteration:
                    finished = True
                    break
                except KeyboardInterrupt:
                    interrupt_at = -1
                    if rng.random() < P_CONTINUE:
                        totals.continued += 1
                        continue  # the same iterator goes on with the next item
                    break  # the checkpoint taken below resumes after `got`
                got.append(x)
                pids.update(loader.worker_pids())
                victims = loader.worker_pids() if i == kill_at else []
                if victims:
                    try:
                        os.kill(rng.choice(victims), signal.SIGKILL)
                        totals.outside_kills += 1
                    except ProcessLookupError:
                        pass  # it had just died (a kill from inside) and is being replaced
                if i == probe_at:  # an interrupted state_dict() leaves the iterator going
                    try:
                        inject.call("state_dict", loader.state_dict)
                    except KeyboardInterrupt:
                        pass
                if i == damage_at:  # a refused load leaves the iterator going
                    _refuse_damaged(loader, loader.state_dict(), rng, totals, live=True)
                i += 1
            state = _state(loader, inject, rng)
            # An interrupt in the next() that would have ended the epoch
            # lands after every item was delivered: the state says this
            # round's epoch (each fresh loader's first, 1) is finished. An
            # interrupted start puts the epoch back: epoch 0, finished.
            finished = finished or (bool(state.get("finished")) and state.get("epoch") == 1)
            m = loader.metrics()["dispatch"]
            totals.restarts += m["restarts"]
            totals.skipped += m["skipped"]
            if not finished:
                totals.closed_mid_epoch += 1
        finally:
            pids.update(loader.worker_pids())
            _close(loader, inject, rng, pids, totals)
        if finished:
            break
        cfg = _config(rng, rng.choice([0, 1, 2, 3]))
        cfg = cp.LoaderConfig(workers=cfg.workers, seed=first.seed)
    totals.rounds += 1
    totals.inside_kills += len(os.listdir(marker_dir))  # one marker per kill
    totals.delivered += len(got)
    want, have = Counter(expected), Counter(got)
    totals.lost += sum((want - have).values())
    totals.duplicated += sum((have - want).values())
    totals.misordered += int(got != expected and want == have)


def _watchdog(timeout_s: float) -> None:
    """Dump every thread's stack to the real stderr and exit after ``timeout_s``."""
    stderr = sys.__stderr__
    if stderr is None:
        return
    try:
        faulthandler.dump_traceback_later(timeout_s, exit=True, file=stderr)
    except (AttributeError, ValueError, OSError):  # no usable stderr: no watchdog
        pass


def _interrupt_line(inject: faults.Interrupts) -> str:
    parts = [
        f"{where} {inject.landed[where]} landed ({inject.missed[where]} missed)"
        for where in ("iter", "state_dict", "close")
    ]
    return ", ".join(parts)


def _epoch_count(text: str) -> int:
    """``--epochs``: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1 (epochs to run), got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m centralpipe soak", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to run (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--epochs",
        type=_epoch_count,
        default=None,
        help="stop after this many epochs (rounds), or at --minutes if that comes first",
    )
    parser.add_argument(
        "--no-interrupts",
        action="store_true",
        help="inject no KeyboardInterrupt (kills, raises and damaged checkpoints only)",
    )
    args = parser.parse_args(argv)
    logging.getLogger("centralpipe").setLevel(
        logging.ERROR if not os.environ.get("SOAK_VERBOSE") else logging.WARNING
    )
    rng = random.Random(args.seed)
    inject = faults.Interrupts(random.Random(rng.randrange(2**32)), enabled=not args.no_interrupts)
    totals = Totals()
    # Start the forkserver (and resource tracker) first: they live for the
    # whole process and are not leaks.
    loader: cp.Loader[Any]
    warm = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=1, start_method="forkserver"))
    with cp.Loader(cp.Pipeline.from_iterable(range(3)).dispatch().map(unbatch), warm) as loader:
        list(loader)
    gc.collect()
    fds_before, children_before = _open_fds(), len(_children())
    threads_before = _threads()
    deadline = time.monotonic() + args.minutes * 60
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        while time.monotonic() < deadline and (args.epochs is None or totals.rounds < args.epochs):
            # A round that takes this long is a hang: every thread's stack is
            # printed and the process exits (no result is better than none).
            _watchdog(ROUND_TIMEOUT_S)
            try:
                _one_round(rng, totals, Path(tmp), inject)
            finally:
                faulthandler.cancel_dump_traceback_later()
    fds_after = _settled_fds(fds_before)
    children_after = len(_children())
    threads_after = _settled_threads(threads_before)
    elapsed = time.monotonic() - started
    refused = sum(totals.refused.values())
    print(f"soak: {elapsed / 60:.1f} min, {totals.rounds} epochs, seed {args.seed}")
    print(f"  items delivered : {totals.delivered}")
    print(f"  items lost      : {totals.lost}")
    print(f"  duplicates      : {totals.duplicated}")
    print(f"  wrong order     : {totals.misordered} epochs")
    print(f"  worker restarts : {totals.restarts}")
    print(
        f"  kills           : {totals.outside_kills} from outside, "
        f"{totals.inside_kills} from inside (the worker stage)"
    )
    print(f"  skipped (raised): {totals.skipped}")
    print(
        f"  resumes         : {totals.resumes} ({totals.closed_mid_epoch} loaders closed mid-epoch)"
    )
    print(f"  interrupts      : {_interrupt_line(inject)}")
    print(f"  went on after   : {totals.continued} interrupted next() (same iterator)")
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(totals.refused.items()))
    print(f"  damaged ckpts   : {refused} refused ({kinds})")
    print(f"  problems        : {len(totals.problems) + sum(inject.converted.values())}")
    for text in totals.problems:
        print(f"    {text}")
    for text, count in inject.converted.items():
        print(f"    interrupt surfaced wrongly ({count}x): {text}")
    leaked_fds = _leaked_fds(fds_before, fds_after)
    print(f"  open fds        : {len(fds_before)} before, {len(fds_after)} after")
    for fd in sorted(set(fds_after) - set(fds_before)):
        what = "  (multiprocessing heap arena, kept by the stdlib)" if fd not in leaked_fds else ""
        print(f"    new fd {fd} -> {fds_after[fd]}{what}")
    print(f"  child processes : {children_before} before, {children_after} after")
    print(f"  threads         : {len(threads_before)} before, {len(threads_after)} after")
    for name in sorted(threads_after - threads_before):
        print(f"    new thread {name}")
    ok = (
        totals.lost == 0
        and totals.duplicated == 0
        and totals.misordered == 0
        and not totals.problems
        and not inject.converted
        and not leaked_fds
        and children_after <= children_before
        and threads_after <= threads_before
    )
    print("soak: PASS" if ok else "soak: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
