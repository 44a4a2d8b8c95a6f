"""The bench's transport part: large-buffer workloads, capped socket buffers,
the cold ``cpu`` epoch and their targets (never asserting a speed)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

import centralpipe as cp
from centralpipe.tools import bench, bench_report, bench_transport, bench_workloads
from centralpipe.tools.bench_contenders import STOCK_SOCKET_BUFFER_BYTES, Timing, socket_buffers

BENCH_TIMEOUT_S = 180


@pytest.mark.slow
@pytest.mark.timeout(BENCH_TIMEOUT_S + 30)
def test_quick_transport_bench_prints_its_tables() -> None:
    """`bench --scale 100 --only tensor,mixed --workers 1` prints the throughput and
    transport tables, the capped rows and the shared-memory share."""
    args = ["bench", "--scale", "100", "--only", "tensor,mixed", "--workers", "1", "--retries", "0"]
    proc = subprocess.run(
        [sys.executable, "-m", "centralpipe", *args],
        capture_output=True,
        text=True,
        timeout=BENCH_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "| tensor | 1 |" in out and "| mixed | 1 |" in out
    assert "## Transport" in out
    transport = out.split("## Transport")[1]
    assert transport.count("| tensor | 1 |") == 1 and transport.count("| mixed | 1 |") == 1
    assert "212,992" in transport
    assert "Traceback" not in proc.stderr


def test_socket_buffer_option_is_checked() -> None:
    """`--socket-buffer` below 4096 is refused with exit status 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "centralpipe", "bench", "--socket-buffer", "100"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--socket-buffer must be >= 4096" in proc.stderr


def test_capped_socket_buffers_reach_the_worker_pipes() -> None:
    """Inside `socket_buffers(212992)` a Loader's worker pipes get the stock
    limit (the kernel doubles what is asked), and the default after it."""

    def sndbuf(loader: cp.Loader[object]) -> int:
        pool = loader._central._res.pool
        assert pool is not None
        conn = pool.slots[0].conn  # type: ignore[attr-defined]
        sock = socket.socket(fileno=conn.fileno())
        try:
            return sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        finally:
            sock.detach()

    pipe = cp.Pipeline.from_iterable(range(4)).dispatch().map(bench_workloads.inc)
    config = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=1, start_method="fork"))
    with socket_buffers(STOCK_SOCKET_BUFFER_BYTES), cp.Loader(pipe, config) as loader:
        assert list(loader) == [1, 2, 3, 4]
        capped = sndbuf(loader)
    with cp.Loader(pipe, config) as loader:
        assert list(loader) == [1, 2, 3, 4]
        default = sndbuf(loader)
    assert capped == 2 * STOCK_SOCKET_BUFFER_BYTES
    assert default >= capped


def test_mixed_workload_spans_1_kib_to_4_mib() -> None:
    """The mixed workload's items are float32 tensors of 1 KiB to 4 MiB."""
    sizes = {bench_workloads.mixed_tensor(i).nbytes for i in range(12)}
    assert min(sizes) == 1024 and max(sizes) == 4 * 2**20
    assert bench_workloads.large_tensor(3).nbytes == 4 * 2**20
    assert torch.equal(bench_workloads.mixed_tensor(7), torch.full((2048,), 7.0))


def _timing(rate: float, shm: float | None = None) -> Timing:
    return Timing(items=int(rate), first_s=0.01, total_s=1.0, shm_share=shm)


def test_targets_cover_tensor_numpy_and_the_cold_epoch() -> None:
    """The tensor rate and DataLoader ratio (default and capped), numpy against
    tensor, and the cold cpu epoch each get a target row, judged as stated."""
    res = bench.Results()
    res.cells[("tensor", 2)] = {
        "centralpipe": _timing(30_000, 1.0),
        bench.CAPPED: _timing(20_000, 1.0),
        "DataLoader": _timing(1_500),
        "ParallelMapper": _timing(1_400),
    }
    res.cells[("numpy", 2)] = {
        "centralpipe": _timing(26_000, 1.0),
        bench.CAPPED: _timing(26_000, 1.0),
        "DataLoader": _timing(1_500),
        "ParallelMapper": _timing(1_400),
    }
    res.serial = {"tensor": _timing(50_000), "numpy": _timing(50_000)}
    res.cold = bench_transport.ColdEpoch(4000, 2, serial_s=4.0, first_s=0.2, total_s=3.2)
    got = {name: ok for name, _, ok in bench_report._targets(res)}
    assert got["tensor, 2 workers: >= 25,000 items/s"] is True
    assert got["tensor, 2 workers: >= 15x DataLoader"] is True
    assert got["tensor, 2 workers, socket buffers capped: >= 25,000 items/s"] is False
    assert got["tensor, 2 workers, socket buffers capped: >= 15x DataLoader"] is False
    assert got["numpy, 2 workers: within 10 % of tensor"] is False  # 0.87x
    cold = [k for k in got if k.startswith("cpu, 2 workers, a process's first Loader")]
    assert len(cold) == 1 and got[cold[0]] is False  # 1.25x
    text = bench.report(res)
    assert "## Transport" in text and "| tensor | 2 | 30,000 | 20,000 | 0.67x |" in text
    res.cells[("tensor", 2)][bench.LIMIT] = _timing(40_000)
    got = {name: ok for name, _, ok in bench_report._targets(res)}
    assert got["tensor, 2 workers: >= 70 % of the slot-pool limit, same run"] is True  # 75 %
    assert (
        got["tensor, 2 workers, socket buffers capped: >= 70 % of the slot-pool limit, same run"]
        is False
    )


def wrong_tensor(i: int) -> torch.Tensor:
    """A 256 KiB tensor that is not item ``i``."""
    return torch.full((bench_workloads.TENSOR_NUMEL,), float(i + 1))


def test_slot_pool_limit_checks_each_item() -> None:
    """The minimal slot-pool loader moves items in order and refuses wrong ones."""
    from centralpipe.tools import bench_limit

    nbytes = bench_workloads.TENSOR_NUMEL * 4
    assert bench_limit.run_slot_pool(bench_workloads.full_tensor, 60, 2, nbytes) > 0
    with pytest.raises(RuntimeError, match=r"item 0 arrived as 1\.0"):
        bench_limit.run_slot_pool(wrong_tensor, 60, 2, nbytes)
