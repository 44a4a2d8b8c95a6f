"""``python -m centralpipe bench --only state``: ``state_dict()`` latency.

Timed from the consuming loop, mid-epoch, with ``STATE_WORKERS`` workers:
every 1,000 items of the ``tiny`` pipeline and every so many batches of a
``shuffle`` + ``bucket_by_max_tokens`` pipeline (``STATE_CALLS`` calls an
epoch); the same ``tiny`` epoch without any call, interleaved, shows what
calling costs; and in a long ``num_workers=0`` epoch, consecutive calls early,
midway and late show that the cost does not grow with the position.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import centralpipe as cp
from centralpipe.checkpoint.model import in_flight_items
from centralpipe.tools.bench_contenders import Timing, settle
from centralpipe.tools.bench_workloads import inc, token_len

__all__ = ["STATE_WORKERS", "StateRun", "measure", "report_lines", "targets"]

STATE_WORKERS = 4
STATE_CALLS = 200
LONG_EPOCH_POINTS = (0.01, 0.5, 0.99)
LONG_EPOCH_SAMPLES = 50
THROUGHPUT_REPEATS = 2


@dataclass
class StateRun:
    timing: Timing
    latencies_s: list[float] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)


def _state_run(pipe: cp.Pipeline, workers: int, every: int, start_method: str | None) -> StateRun:
    """Iterate one epoch, calling ``state_dict()`` after every ``every``-th item."""
    config = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=workers, start_method=start_method)
    )
    lat: list[float] = []
    flight: list[int] = []
    clock = time.perf_counter
    t0 = clock()
    with cp.Loader[Any](pipe, config) as loader:
        it = iter(loader)
        n = 0
        first = 0.0
        for _ in it:
            n += 1
            if n == 1:
                first = clock() - t0
            if n % every == 0:
                s = clock()
                sd = loader.state_dict()
                lat.append(clock() - s)
                flight.append(in_flight_items(sd))
        total = clock() - t0
    return StateRun(Timing(n, first, total), lat, flight)


def tiny_pipe(n: int) -> cp.Pipeline:
    return cp.Pipeline.from_iterable(range(n)).dispatch().map(inc)


def bucket_pipe(n: int) -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(range(n))
        .shuffle(1000)
        .bucket_by_max_tokens(256, len_fn=token_len, buffer_size=1000)
        .dispatch()
        .map(len)
    )


def long_epoch_latency(n: int) -> dict[float, list[float]]:
    """``state_dict()`` latencies around fractions of an ``n``-item epoch
    (``num_workers=0``): ``LONG_EPOCH_SAMPLES`` consecutive calls per point."""
    pipe = cp.Pipeline.from_iterable(range(n)).map(inc)
    out: dict[float, list[float]] = {}
    clock = time.perf_counter
    with cp.Loader[Any](pipe) as loader:
        it = iter(loader)
        pos = 0
        for frac in LONG_EPOCH_POINTS:
            start = max(pos, int(frac * n) - LONG_EPOCH_SAMPLES // 2)
            deque(islice(it, start - pos), maxlen=0)
            pos = start
            lat = []
            for _ in range(LONG_EPOCH_SAMPLES):
                next(it)
                pos += 1
                s = clock()
                loader.state_dict()
                lat.append(clock() - s)
            out[frac] = lat
    return out


def measure(scale: int, start_method: str | None, log: Callable[[str], None]) -> dict[str, Any]:
    """The whole section; sizes divided by ``scale``."""
    state: dict[str, Any] = {}
    n = 200_000 // scale
    every = max(1, n // STATE_CALLS)
    log(f"state: tiny, {STATE_WORKERS} workers, state_dict() every {every} items")
    quiet, calling = [], []
    for _ in range(THROUGHPUT_REPEATS):  # interleaved, best of each: the machine is noisy
        settle()
        quiet.append(_state_run(tiny_pipe(n), STATE_WORKERS, n + 1, start_method))
        settle()
        calling.append(_state_run(tiny_pipe(n), STATE_WORKERS, every, start_method))
    state["tiny_every"] = every
    state["tiny_quiet"] = max(quiet, key=lambda r: r.timing.rate)
    state["tiny_calling"] = max(calling, key=lambda r: r.timing.rate)
    state["tiny_latency"] = [x for r in calling for x in r.latencies_s]
    state["tiny_flight"] = [x for r in calling for x in r.in_flight]
    with cp.Loader[Any](bucket_pipe(n)) as loader:
        outputs = sum(1 for _ in loader)
    b_every = max(1, outputs // STATE_CALLS)
    log(f"state: shuffle+bucket, {STATE_WORKERS} workers, every {b_every} batches")
    settle()
    run_b = _state_run(bucket_pipe(n), STATE_WORKERS, b_every, start_method)
    state["bucket"] = run_b
    state["bucket_every"] = b_every
    long_n = 1_000_000 // scale
    log(f"state: {long_n:,}-item epoch, num_workers=0")
    state["long_n"] = long_n
    state["long"] = long_epoch_latency(long_n)
    return state


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} µs"


def _p99(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]


def report_lines(st: dict[str, Any]) -> list[str]:
    if not st:
        return []
    lat, flight = st["tiny_latency"], st["tiny_flight"]
    b: StateRun = st["bucket"]
    lines = [
        "",
        "## state_dict()",
        "",
        "Latency of `loader.state_dict()` called from the consuming loop.",
        "",
        "| pipeline | workers | calls | median | p99 | in-flight items (median) |",
        "|---|--:|--:|--:|--:|--:|",
        f"| tiny, every {st['tiny_every']:,} items | {STATE_WORKERS} | {len(lat)} "
        f"| {_us(statistics.median(lat))} | {_us(_p99(lat))} "
        f"| {statistics.median(flight):,.0f} |",
        f"| shuffle(1000) + bucket_by_max_tokens(buffer_size=1000), every "
        f"{st['bucket_every']:,} batches | {STATE_WORKERS} | {len(b.latencies_s)} "
        f"| {_us(statistics.median(b.latencies_s))} | {_us(_p99(b.latencies_s))} "
        f"| {statistics.median(b.in_flight):,.0f} |",
    ]
    for frac, xs in st["long"].items():
        lines.append(
            f"| `from_iterable(range({st['long_n']:_})).map(f)`, at {frac:.0%} of the epoch "
            f"| 0 | {len(xs)} | {_us(statistics.median(xs))} | {_us(_p99(xs))} | 0 |"
        )
    q, c = st["tiny_quiet"].timing, st["tiny_calling"].timing
    lines += [
        "",
        f"Throughput of `tiny` with {STATE_WORKERS} workers (best of "
        f"{THROUGHPUT_REPEATS} runs each, interleaved):",
        "",
        "| state_dict() calls | items/s | relative |",
        "|---|--:|--:|",
        f"| none | {q.rate:,.0f} | 1.00 |",
        f"| every {st['tiny_every']:,} items | {c.rate:,.0f} | {c.rate / q.rate:.2f} |",
    ]
    return lines


def targets(st: dict[str, Any]) -> list[tuple[str, str, bool]]:
    out = []
    if st:
        for label, xs in (
            ("tiny", st["tiny_latency"]),
            ("shuffle+bucket", st["bucket"].latencies_s),
        ):
            med = statistics.median(xs)
            out.append(
                (
                    f"state_dict() median < 1 ms, {STATE_WORKERS} workers, {label}",
                    _us(med),
                    med < 1e-3,
                )
            )
    return out
