"""Chunks go round-robin to the workers within each stream.

A parallel central stage and the dispatch boundary are two streams over the
same workers. With one turn shared by both, their interleaving decided the
load: on the motivating pipeline (a tokenizer stage, then a pad after
``dispatch()``), a tokenizer chunk and a pad chunk went out in turn, so on 2
workers every tokenizer chunk landed on one worker and every pad chunk on the
other, and the second worker idled a fifth of the time. Each stream now has
its own turn: its k-th chunk goes to worker ``(stream + k) % num_workers``.
"""

from __future__ import annotations

from typing import Any

import pytest

import centralpipe as cp
from centralpipe.dispatch.reorder import StreamStats
from centralpipe.dispatch.supervisor import Policy, Supervisor
from tests.fns import faulty
from tests.fns import fused as f

N = 240
CHUNK = 10


class _Pool:
    """The executor as a Supervisor sees it before its run starts."""

    def __init__(self, n: int) -> None:
        self.slots = [object() for _ in range(n)]

    def lendable_bytes(self) -> int:
        return 0

    def interrupt(self) -> None:
        pass


def _supervisor(workers: int) -> Supervisor:
    policy = Policy.of(cp.WorkerConfig(num_workers=workers))
    return Supervisor(_Pool(workers), 0, policy, StreamStats(workers))  # type: ignore[arg-type]


def test_streams_sent_in_turn_each_alternate_workers() -> None:
    """Two streams whose chunks go out in strict turn: each stream's chunks
    still alternate between the 2 workers (a shared turn gave stream 0
    worker 0 and stream 1 worker 1 every time)."""
    sup = _supervisor(2)
    sent: dict[int, list[int]] = {0: [], 1: []}
    for _ in range(4):
        for stream in (0, 1):
            sent[stream].append(sup.next_slot(stream))
    assert sent == {0: [0, 1, 0, 1], 1: [1, 0, 1, 0]}


def test_each_stream_starts_at_its_own_worker_and_cycles() -> None:
    """Stream i starts at worker i mod n, then cycles over all n workers,
    whatever the other streams do."""
    sup = _supervisor(3)
    got = [(s, sup.next_slot(s)) for s in (0, 1, 1, 2, 0, 4, 1, 0, 2, 4, 4)]
    assert got == [
        (0, 0), (1, 1), (1, 2), (2, 2), (0, 1), (4, 1), (1, 0), (0, 2), (2, 0), (4, 2), (4, 0),
    ]  # fmt: skip
    one = _supervisor(1)
    assert {one.next_slot(s) for s in range(5)} == {0}


def _loader(workers: int) -> cp.Loader[Any]:
    pipe = cp.Pipeline.from_iterable(range(N)).map(f.double, parallel=True, name="a")
    pipe = pipe.dispatch().map(faulty.identity)
    cfg = cp.WorkerConfig(
        num_workers=workers, start_method="fork", chunk_size=CHUNK, buffer_size=6 * CHUNK
    )
    return cp.Loader(pipe, cp.LoaderConfig(workers=cfg))


@pytest.mark.parametrize("workers", [2, 3])
def test_a_parallel_stage_and_the_boundary_each_go_round_robin(
    monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """In a real run, the chunks of the parallel stage and of the boundary
    (sent interleaved by one thread) each cycle over every worker from their
    own start, and each stream's items reach every worker."""
    sent: list[tuple[int, int]] = []
    real = Supervisor.next_slot

    def recording(self: Supervisor, stream_id: int) -> int:
        slot = real(self, stream_id)
        sent.append((stream_id, slot))
        return slot

    monkeypatch.setattr(Supervisor, "next_slot", recording)
    with _loader(workers) as loader:
        assert list(loader) == [2 * x for x in range(N)]
        m = loader.metrics()
    streams = sorted({s for s, _ in sent})
    assert len(streams) == 2, sent
    for stream in streams:
        slots = [slot for s, slot in sent if s == stream]
        assert len(slots) >= N // CHUNK, (stream, slots)
        assert slots == [(stream + k) % workers for k in range(len(slots))], slots
    for per_worker in (m["a"]["parallel"]["items_per_worker"], m["dispatch"]["items_per_worker"]):
        assert sum(per_worker) == N and all(per_worker), per_worker
