"""Ranks under any launcher (torchrun, Lightning) and the duplicated-data warning."""

from __future__ import annotations

import socket
import warnings
from collections.abc import Iterator

import pytest

import centralpipe as cp
from centralpipe import launchers
from tests.support.configs import LAUNCHER_ENV_NAMES

ENV_NAMES = LAUNCHER_ENV_NAMES


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """A clean launcher environment: none of the rank variables set."""
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch


def _set(monkeypatch: pytest.MonkeyPatch, values: dict[str, str]) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def process_group() -> Iterator[None]:
    """A real one-rank gloo process group for the duration of the test."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "1", "NODE_RANK": "0"}, (1, 2, 1)),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, (1, 2, 1)),
        ({"WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, (3, 4, 3)),
        (
            {"WORLD_SIZE": "4", "LOCAL_RANK": "1", "NODE_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
            (3, 4, 1),
        ),
        (
            {"WORLD_SIZE": "4", "LOCAL_RANK": "0", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
            (2, 4, 0),
        ),
        ({"WORLD_SIZE": "1"}, (0, 1, None)),
        ({"WORLD_SIZE": "1", "LOCAL_RANK": "0"}, (0, 1, 0)),
    ],
    ids=[
        "lightning-one-node",
        "no-node-hints",
        "local-world-is-world",
        "node-1-of-2",
        "torchrun-group-rank",
        "world-1",
        "world-1-local-0",
    ],
)
def test_from_env_without_rank(
    env: pytest.MonkeyPatch, values: dict[str, str], expected: tuple[int, int, int | None]
) -> None:
    """WORLD_SIZE + LOCAL_RANK without RANK (Lightning's launcher) give the rank when it is sure."""
    _set(env, values)
    config = cp.DistributedConfig.from_env()
    assert (config.rank, config.world_size, config.local_rank) == expected


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "several nodes"),
        ({"WORLD_SIZE": "4", "LOCAL_RANK": "1", "SLURM_NNODES": "2"}, "several nodes"),
        ({"WORLD_SIZE": "4", "LOCAL_RANK": "1", "NODE_RANK": "1"}, "needs LOCAL_WORLD_SIZE"),
        ({"WORLD_SIZE": "4", "LOCAL_RANK": "1", "NODE_RANK": "1", "GROUP_RANK": "0"}, "disagree"),
        ({"WORLD_SIZE": "2"}, "neither RANK nor LOCAL_RANK"),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "2"}, "`rank` must be in"),
        ({"WORLD_SIZE": "two", "LOCAL_RANK": "0"}, "WORLD_SIZE must be an int, got 'two'"),
    ],
    ids=[
        "two-nodes-no-node-rank",
        "slurm-two-nodes",
        "node-rank-without-local-world",
        "node-and-group-rank-differ",
        "world-only",
        "local-rank-too-large",
        "not-an-int",
    ],
)
def test_from_env_refuses_to_guess(
    env: pytest.MonkeyPatch, values: dict[str, str], match: str
) -> None:
    """A rank that cannot be derived for sure is a `ConfigError` saying what to set."""
    _set(env, values)
    with pytest.raises(cp.ConfigError, match=match):
        cp.DistributedConfig.from_env()


@pytest.mark.usefixtures("process_group")
def test_from_env_prefers_the_process_group_to_a_partial_environment(
    env: pytest.MonkeyPatch,
) -> None:
    """With a process group, WORLD_SIZE + LOCAL_RANK without RANK (Lightning) are accepted."""
    _set(env, {"WORLD_SIZE": "1", "LOCAL_RANK": "0", "NODE_RANK": "0"})
    assert cp.DistributedConfig.from_env() == cp.DistributedConfig(
        rank=0, world_size=1, local_rank=0
    )
    _set(env, {"RANK": "x"})
    with pytest.raises(cp.ConfigError, match="RANK must be an int"):
        cp.DistributedConfig.from_env()


@pytest.mark.usefixtures("process_group")
def test_from_env_refuses_a_world_size_that_contradicts_the_group(
    env: pytest.MonkeyPatch,
) -> None:
    """WORLD_SIZE alone that disagrees with the process group is a `ConfigError` naming both."""
    _set(env, {"WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(cp.ConfigError, match=r"rank 0 of 1.*None of 2"):
        cp.DistributedConfig.from_env()


def test_a_single_rank_loader_in_a_multi_rank_job_warns(env: pytest.MonkeyPatch) -> None:
    """A Loader of world size 1 warns loudly when WORLD_SIZE says the job has more ranks."""
    pipe = cp.Pipeline.from_iterable(range(4))
    _set(env, {"WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    with pytest.warns(RuntimeWarning, match=r"job has 2 ranks.*SAME items") as caught:
        cp.Loader(pipe).close()
    assert caught[0].filename == __file__, "the warning points at the caller"


def test_a_single_rank_loader_in_a_multi_rank_group_warns(
    env: pytest.MonkeyPatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Loader of world size 1 warns when the initialised process group has more ranks."""
    monkeypatch.setattr(launchers, "group_ranks", lambda: (1, 4))
    with pytest.warns(RuntimeWarning, match="job has 4 ranks"):
        cp.Loader(cp.Pipeline.from_iterable(range(4))).close()


@pytest.mark.parametrize(
    "values",
    [{}, {"WORLD_SIZE": "1"}, {"WORLD_SIZE": "2", "RANK": "1"}],
    ids=["no-launcher", "world-1", "configured"],
)
def test_no_warning_when_the_ranks_agree(env: pytest.MonkeyPatch, values: dict[str, str]) -> None:
    """No warning without a launcher, in a one-rank job, or with the job's ranks configured."""
    _set(env, values)
    config = cp.LoaderConfig(distributed=cp.DistributedConfig.from_env())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cp.Loader(cp.Pipeline.from_iterable(range(4)).shard(), config).close()
