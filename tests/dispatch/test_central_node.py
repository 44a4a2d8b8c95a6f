"""``LoaderConfig(central="node")`` on one local rank (a 1-rank node is its
service): the same outputs, checkpoints and queries as ``"process"``, states
of two ranks resumed on one, the pipelines it refuses, bad launcher
variables and a damaged token file. Two local ranks under torchrun:
``tests/loader/test_central_node_distributed.py``."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import centralpipe as cp
from centralpipe.dispatch import nodeservice, priority
from centralpipe.dispatch.worker.loop import main_alive
from examples.token_buckets import DATA_GLOB, collate_pad, tokenize

N = 23


def square(x: int) -> int:
    return x * x


def plus_one(x: int) -> int:
    return x + 1


def _pipe(equalize: str | None = "drop_last") -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(range(N))
        .shuffle(5)
        .map(square)
        .count("pre_shard")
        .shard(equalize=equalize)
        .dispatch()
        .map(plus_one)
    )


def _config(central: str, rank: int = 0, world_size: int = 1, workers: int = 2) -> cp.LoaderConfig:
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=workers, start_method="fork", buffer_size=4),
        distributed=cp.DistributedConfig(rank=rank, world_size=world_size),
        central=central,
    )


@pytest.fixture(autouse=True)
def _one_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("equalize", [None, "drop_last", "pad"], ids=["none", "drop_last", "pad"])
def test_two_epochs_equal_process_mode(equalize: str | None) -> None:
    """Two epochs of a node-mode Loader equal those of a process-mode one."""
    pipe = _pipe(equalize)
    with cp.Loader(pipe, _config("process")) as loader:
        expected = [list(loader), list(loader)]
    with cp.Loader(pipe, _config("node")) as loader:
        assert [list(loader), list(loader)] == expected
    assert len(expected[0]) == N


@pytest.mark.parametrize(
    "saved,resumed",
    [("node", "process"), ("process", "node"), ("node", "node")],
    ids=["node-to-process", "process-to-node", "node-to-node"],
)
@pytest.mark.parametrize("step", [0, 1, 9, N], ids=["k0", "k1", "k9", "end"])
def test_resume_is_exact_across_modes(saved: str, resumed: str, step: int) -> None:
    """The first ``step`` items plus the rest resumed in another mode equal the epoch."""
    pipe = _pipe()
    with cp.Loader(pipe, _config("process")) as loader:
        expected = list(loader)
    with cp.Loader(pipe, _config(saved)) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(step)]
        state = loader.state_dict()
    with cp.Loader(pipe, _config(resumed)) as loader:
        loader.load_state_dict(state)
        assert head + list(loader) == expected


def test_state_has_the_per_rank_format() -> None:
    """A node-mode state has process mode's keys and rank fields, and
    ``query``/``metrics`` answer as in process mode."""
    pipe = _pipe()
    states, queries = [], []
    for mode in ("process", "node"):
        with cp.Loader(pipe, _config(mode)) as loader:
            it = iter(loader)
            for _ in range(5):
                next(it)
            states.append(loader.state_dict())
            queries.append(loader.query("pre_shard", delivered=True))
            assert "dispatch" in loader.metrics()
    assert sorted(states[0]) == sorted(states[1])
    assert states[1]["distributed"] == {"rank": 0, "world_size": 1, "merged": False}
    assert queries[0] == queries[1] == {"items": 5, "weight": 5.0}


def test_two_ranks_states_resume_on_a_one_rank_node() -> None:
    """Two ranks' states, merged, resume on a 1-rank node with every item
    neither rank had delivered (the round drop_last dropped included), as a
    1-rank process-mode Loader resumes them."""
    pipe = _pipe()
    states, heads = [], []
    for rank in range(2):
        with cp.Loader(pipe, _config("process", rank, 2, workers=0)) as loader:
            it = iter(loader)
            heads += [next(it) for _ in range(4)]
            states.append(loader.state_dict())
    merged = cp.merge_states(states)
    rests = []
    for mode in ("process", "node"):
        with cp.Loader(pipe, _config(mode)) as loader:
            loader.load_state_dict(merged)
            rests.append(list(loader))
    assert rests[0] == rests[1]
    assert sorted(heads + rests[1]) == sorted(x * x + 1 for x in range(N))


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: cp.Pipeline.from_iterable(range(4)).dispatch().map(plus_one), "has no shard()"),
        (
            lambda: cp.Pipeline.from_iterable(range(4)).shard().map(square).dispatch(),
            "shard() to be the last central stage",
        ),
        (
            lambda: cp.Pipeline.from_iterable(range(4)).shard().shard().dispatch(),
            "exactly one shard()",
        ),
    ],
    ids=["no-shard", "stage-after-shard", "two-shards"],
)
def test_pipelines_node_mode_refuses(make: Any, message: str) -> None:
    """Pipelines node mode cannot run are a ``PipelineError`` saying why."""
    with pytest.raises(cp.PipelineError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cp.Loader(make(), _config("node"))


@pytest.mark.parametrize(
    "env,message",
    [
        ({"LOCAL_RANK": "x", "LOCAL_WORLD_SIZE": "2"}, "integer LOCAL_RANK"),
        ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "0 <= LOCAL_RANK < LOCAL_WORLD_SIZE"),
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "torchrun's layout"),
    ],
    ids=["not-int", "out-of-range", "layout"],
)
def test_bad_launcher_variables(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    """Launcher variables node mode cannot use are a ``ServiceError`` naming them."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(cp.ServiceError, match=message):
        cp.Loader(_pipe(), _config("node", rank=0, world_size=2))


def test_token_file_is_private_and_read_back(tmp_path: Path) -> None:
    """The token is written ``0600`` and read back exactly."""
    path = tmp_path / "t.token"
    token = os.urandom(32)
    nodeservice.write_token(path, token)
    assert path.stat().st_mode & 0o777 == 0o600
    assert nodeservice.read_token(path, 1.0) == token


@pytest.mark.parametrize(
    "setup,message",
    [
        (lambda p: None, "no central service of this node appeared"),
        (lambda p: (p.write_bytes(b"short"), p.chmod(0o600)), "is damaged"),
        (lambda p: (p.write_bytes(b"x" * 32), p.chmod(0o644)), "mode 0600"),
    ],
    ids=["missing", "damaged", "readable-by-others"],
)
def test_bad_token_files_are_refused(tmp_path: Path, setup: Any, message: str) -> None:
    """A missing, damaged or world-readable token file is a ``ServiceError``."""
    path = tmp_path / "t.token"
    setup(path)
    with pytest.raises(cp.ServiceError, match=message):
        nodeservice.read_token(path, 0.2)


#: Two of the bundled corpus's four files (about 3,000 lines): the whole
#: corpus makes each of these tests several times slower and checks nothing more.
SEED_FILES = [str(Path(DATA_GLOB).parent / f"part-00{i}.txt") for i in (0, 2)]


def _seed(bucket_buffer: int = 64) -> cp.Pipeline:
    """The seed pipeline on part of the bundled corpus, with a small bucket
    buffer so that a checkpoint finds the parallel tokenizer's inputs in flight."""
    return (
        cp.Pipeline.from_files(SEED_FILES)
        .read_lines()
        .map(tokenize, parallel=True)
        .bucket_by_max_tokens(256, len_fn=len, buffer_size=bucket_buffer, min_len=1)
        .count("pre_shard", weight_fn=len)
        .shard(equalize="drop_last")
        .dispatch()
        .map(collate_pad)
    )


def _counted_twice() -> cp.Pipeline:
    """A ``count`` before and after a parallel stage: both stamp each item."""
    return (
        cp.Pipeline.from_iterable(range(N))
        .count("raw")
        .map(square, parallel=True)
        .filter(lambda x: x % 3 != 0)
        .count("pre_shard")
        .shard()
        .dispatch()
        .map(plus_one)
    )


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@functools.cache
def _process_mode_epoch() -> list[Any]:
    """The seed pipeline's epoch in process mode (2 workers), read once."""
    with cp.Loader(_seed(), _config("process")) as loader:
        return list(loader)


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_seed_pipeline_equals_process_mode(workers: int) -> None:
    """The seed pipeline (parallel tokenizer before shard) gives in node mode
    exactly the batches of process mode, at 0-3 workers."""
    pipe = _seed()
    with cp.Loader(pipe, _config("process", workers=workers)) as loader:
        expected = list(loader)
    with cp.Loader(pipe, _config("node", workers=workers)) as loader:
        got = list(loader)
    assert len(expected) > 100
    assert _same(got, expected)


@pytest.mark.parametrize(
    "saved,resumed", [("node", "process"), ("process", "node"), ("node", "node")]
)
@pytest.mark.parametrize("step", [1, 40])
def test_seed_pipeline_resumes_exactly_across_modes(saved: str, resumed: str, step: int) -> None:
    """A node-mode state of the seed pipeline holds the tokenizer's in-flight
    lines (as byte ranges), and resumes exactly in either mode."""
    pipe = _seed()
    expected = _process_mode_epoch()
    with cp.Loader(pipe, _config(saved)) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(step)]
        state = loader.state_dict()
    entry = state["in_flight"]["map_2"]
    assert entry["items"] or entry.get("ranges"), "the tokenizer had nothing in flight"
    with cp.Loader(pipe, _config(resumed)) as loader:
        loader.load_state_dict(state)
        assert _same(head + list(loader), expected)


def test_counts_before_a_parallel_stage_are_stamped_exactly() -> None:
    """With a ``count`` before the shared parallel stage and one after it,
    node mode's outputs, delivered counts and resumed rest equal process mode's."""
    pipe = _counted_twice()
    seen: dict[str, Any] = {}
    for mode in ("process", "node"):
        with cp.Loader(pipe, _config(mode)) as loader:
            it = iter(loader)
            head = [next(it) for _ in range(4)]
            queries = [loader.query(n, delivered=True) for n in ("raw", "pre_shard")]
            state = loader.state_dict()
        with cp.Loader(pipe, _config("process")) as loader:
            loader.load_state_dict(state)
            resumed = [loader.query(n, delivered=True) for n in ("raw", "pre_shard")]
            seen[mode] = (head, queries, resumed, list(loader))
    assert seen["node"] == seen["process"]
    assert seen["node"][1][1] == {"items": 4, "weight": 4.0}


def test_seed_pipeline_node_workers_end_with_close() -> None:
    """The node-wide pool of the shared tokenizer is among the Loader's
    worker pids, and it ends with the service when the Loader closes."""
    with cp.Loader(_seed(), _config("node", workers=2)) as loader:
        it = iter(loader)
        assert isinstance(next(it), torch.Tensor)
        pids = [loader._central.service_pid, *loader.worker_pids()]  # type: ignore[attr-defined]
    assert len(pids) == 1 + 2 + 2  # the service, the rank's 2 and the tokenizer's 2
    deadline = time.monotonic() + 10
    while any(main_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if main_alive(p)] == []


def test_the_node_service_and_its_workers_run_nicer_than_the_rank() -> None:
    """As with central="service": the node service and its workers run
    ``priority.NICENESS`` points nicer; the rank's process keeps its niceness."""
    from tests.dispatch.test_central_service import nice_of

    mine = nice_of(os.getpid())
    with cp.Loader(_pipe(), _config("node")) as loader:
        it = iter(loader)
        next(it)
        helpers = [loader._central.service_pid, *loader.worker_pids()]  # type: ignore[attr-defined]
        assert len(helpers) == 3
        assert [nice_of(p) for p in helpers] == [min(mine + priority.NICENESS, 19)] * 3
        assert nice_of(os.getpid()) == mine
        list(it)
