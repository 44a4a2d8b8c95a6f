"""The new readers with everything downstream (parallel maps, mix, pack, shard),
and Ctrl-C while they open a file."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import centralpipe as cp
import centralpipe.stages.jsonl as jsonl_module
from centralpipe.testing import assert_resumes_exactly, checkpoint_after, items_until_interrupt
from tests.support.configs import loader_config

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


class Trip:
    """``fn``, except that its ``k``-th call raises KeyboardInterrupt (once)."""

    def __init__(self, fn: Callable[..., Any], k: int) -> None:
        self.fn, self.k, self.calls = fn, k, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.k:
            raise KeyboardInterrupt(f"injected at call {self.k}")
        return self.fn(*args, **kwargs)


def _n(row: dict[str, Any]) -> int:
    return row["n"]


def _tokens(n: int) -> list[int]:
    return list(range(n % 5 + 1))


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """JSON lines (plain and gzip) and Parquet files of records {"n": i}."""
    for i in range(3):
        lines = b"".join(json.dumps({"n": 10 * i + j}).encode() + b"\n" for j in range(10))
        (tmp_path / f"{i}.jsonl.gz").write_bytes(
            gzip.compress(lines[:50]) + gzip.compress(lines[50:])
        )
        table = pa.Table.from_pylist([{"n": 100 + 10 * i + j} for j in range(10)])
        pq.write_table(table, str(tmp_path / f"{i}.parquet"), row_group_size=4)
    return tmp_path


def _mixed(root: Path) -> cp.Pipeline:
    jsonl = cp.Pipeline.from_files(str(root / "*.jsonl.gz")).read_jsonl(field="n")
    parquet = cp.Pipeline.from_files(str(root / "*.parquet")).read_parquet().map(_n)
    return cp.Pipeline.mix({"j": jsonl, "p": parquet}, {"j": 0.5, "p": 0.5})


@pytest.mark.parametrize(("workers", "resume_workers"), [(0, 0), (2, 0)], ids=["0-0", "2-0"])
def test_mix_of_readers_with_parallel_map_and_pack(
    corpus: Path, workers: int, resume_workers: int
) -> None:
    """read_jsonl and read_parquet mixed, tokenised by a parallel map and packed,
    resume exactly, across worker counts."""
    pipe = _mixed(corpus).map(_tokens, parallel=True).pack(8, buffer_size=4).dispatch()
    full = assert_resumes_exactly(
        pipe,
        loader_config(num_workers=workers),
        resume_config=loader_config(num_workers=resume_workers),
        ks=None if workers == 0 else [0, 1, 5, 12, 20],
    )
    packed = sorted(len(t) for seq in full for t in seq)
    assert packed == sorted(n % 5 + 1 for n in [*range(30), *range(100, 130)])


@pytest.mark.parametrize("rank", [0, 1])
def test_shard_of_a_reader(corpus: Path, rank: int) -> None:
    """A shard of read_parquet rows gives this rank's share and resumes exactly."""
    pipe = cp.Pipeline.from_files(str(corpus / "*.parquet")).read_parquet().map(_n).shard()
    config = loader_config(rank=rank, world_size=2)
    full = assert_resumes_exactly(pipe, config)
    assert full == list(range(100 + rank, 130, 2))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reader", ["jsonl", "parquet"])
def test_interrupt_while_a_reader_opens_a_file(
    corpus: Path, monkeypatch: pytest.MonkeyPatch, reader: str
) -> None:
    """Ctrl-C while a reader opens its second file: the file stays the stage's (at
    its start), so neither the pass nor the checkpoint skips it."""
    if reader == "jsonl":
        pipe = cp.Pipeline.from_files(str(corpus / "*.jsonl.gz")).read_jsonl(field="n")
        name = "read_jsonl_1"
    else:
        pipe = cp.Pipeline.from_files(str(corpus / "*.parquet")).read_parquet().map(_n)
        name = "read_parquet_1"
    config = loader_config(buffer_size=1, chunk_size=1)
    with cp.Loader(pipe, config) as loader:
        expected = list(loader)
    if reader == "jsonl":
        monkeypatch.setattr(jsonl_module, "open_binary", Trip(jsonl_module.open_binary, 2))
    else:
        monkeypatch.setattr(pq, "ParquetFile", Trip(pq.ParquetFile, 2))
    with cp.Loader(pipe, config) as loader:
        it = iter(loader)
        got = items_until_interrupt(it)
        state = loader.state_dict()
        assert state["central"][name]["path"] == (
            "1.jsonl.gz" if reader == "jsonl" else "1.parquet"
        )
        assert got + list(it) == expected
    with cp.Loader(pipe, config) as fresh:
        fresh.load_state_dict(state)
        assert got + list(fresh) == expected


def test_elastic_resume_of_read_jsonl(corpus: Path) -> None:
    """read_jsonl behind shard(): 2 ranks' states merged resume on 3 ranks with
    each new rank's shard of exactly the rest of the stream."""
    pipe = cp.Pipeline.from_files(str(corpus / "*.jsonl.gz")).read_jsonl(field="n").shard()
    stream = list(range(30))
    k = 4
    states = []
    for rank in range(2):
        head, state = checkpoint_after(pipe, k, loader_config(rank=rank, world_size=2))
        assert head == stream[rank : 2 * k : 2]
        states.append(state)
    merged = cp.merge_states(states)
    rest = stream[2 * k :]
    for rank in range(3):
        with cp.Loader(pipe, loader_config(rank=rank, world_size=3)) as loader:
            loader.load_state_dict(merged)
            assert list(loader) == rest[rank::3]
