"""Two ranks under torchrun (gloo on loopback), two workers each.

The ranks run ``tests/scripts/dist_worker.py`` and write what they saw to JSON files;
the assertions are made here, on both ranks' files together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import centralpipe as cp
from tests.support.torchrun import RUN_TIMEOUT_S, rank_results, torchrun

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "scripts" / "dist_worker.py"
TOKEN_BUCKETS = ROOT / "examples" / "token_buckets.py"
N = 101  # as in dist_worker.py
WORLD_SIZE = 2

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each rank of one torchrun launch of ``dist_worker.py`` wrote."""
    return rank_results(WORKER, tmp_path_factory.mktemp("dist"), nproc=WORLD_SIZE)


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_from_env_agrees_with_the_process_group(ranks: list[dict[str, Any]]) -> None:
    """``DistributedConfig.from_env()`` gives the initialised group's rank and size."""
    for r, result in enumerate(ranks):
        assert result["group"] == result["from_env"] == [r, WORLD_SIZE]


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_shards_without_equalize_are_disjoint_and_complete(ranks: list[dict[str, Any]]) -> None:
    """With ``equalize=None`` the ranks split the stream: no item twice, none lost."""
    shards = [result["shards"]["None"] for result in ranks]
    expected = sorted(x * x + 1 for x in range(N))
    assert sorted(shards[0] + shards[1]) == expected
    assert not set(shards[0]) & set(shards[1])
    assert [len(s) for s in shards] == [(N + 1) // 2, N // 2]


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_equalized_shards_have_equal_length(ranks: list[dict[str, Any]]) -> None:
    """``drop_last`` drops the last incomplete round; ``pad`` completes it from
    that round's items, so together the ranks still hold every item."""
    unequal = [result["shards"]["None"] for result in ranks]
    drop = [result["shards"]["drop_last"] for result in ranks]
    pad = [result["shards"]["pad"] for result in ranks]
    assert [len(s) for s in drop] == [N // WORLD_SIZE] * WORLD_SIZE
    assert [len(s) for s in pad] == [-(-N // WORLD_SIZE)] * WORLD_SIZE
    # Same central order on every rank: equalizing only trims or fills the end.
    for r in range(WORLD_SIZE):
        assert drop[r] == unequal[r][: N // WORLD_SIZE]
        assert pad[r][: len(unequal[r])] == unequal[r]
    assert sorted(set(pad[0] + pad[1])) == sorted(x * x + 1 for x in range(N))
    assert pad[1][-1] == unequal[0][-1]  # rank 1 reuses the last round's only item


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_pre_shard_count_is_identical_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """After a full pass every rank reports the same pre-shard count: the whole
    central stream, not its shard."""
    for key in ("None", "drop_last", "pad"):
        counts = [result["pre_shard"][key] for result in ranks]
        assert counts == [{"items": N, "weight": N}] * WORLD_SIZE, key


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_checkpoints_at_the_same_step_resume_exactly_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    """Each rank checkpoints at step k, resumes in a fresh loader (from the
    ``torch.save`` file) and gets its uninterrupted output."""
    for r, result in enumerate(ranks):
        for key, checks in result["resume"].items():
            assert checks and all(checks.values()), (r, key, checks)


def _pipe() -> cp.Pipeline:
    return cp.Pipeline.from_iterable(range(20)).count("pre_shard").shard().dispatch().map(abs)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("saved", "loading"),
    [
        pytest.param((0, 2), (0, 1), id="2-to-1"),
        pytest.param((0, 1), (0, 2), id="1-to-2"),
        pytest.param((0, 2), (1, 2), id="rank0-to-rank1"),
    ],
)
def test_checkpoint_of_another_world_size_or_rank_is_refused(
    saved: tuple[int, int], loading: tuple[int, int]
) -> None:
    """Resuming on another world size (or another rank's checkpoint) is a
    CheckpointError naming both, never a silently wrong resume."""

    def config(rank: int, world_size: int) -> cp.LoaderConfig:
        return cp.LoaderConfig(distributed=cp.DistributedConfig(rank=rank, world_size=world_size))

    with cp.Loader(_pipe(), config(*saved)) as loader:
        it = iter(loader)
        next(it)
        sd = loader.state_dict()
    refused = pytest.raises(cp.CheckpointError, match=f"rank {saved[0]} of {saved[1]}")
    with cp.Loader(_pipe(), config(*loading)) as loader, refused:
        loader.load_state_dict(sd)


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_token_buckets_example_under_torchrun(tmp_path: Path) -> None:
    """The motivating example resumes exactly on both ranks under torchrun."""
    proc = torchrun(
        TOKEN_BUCKETS,
        *("--workers", "2", "--distributed", "--checkpoint", str(tmp_path / "c.pt")),
        nproc=WORLD_SIZE,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "resumed exactly:" in line]
    assert len(lines) == WORLD_SIZE, proc.stdout
    for r in range(WORLD_SIZE):
        assert any(
            line.startswith(f"[rank {r}] resumed exactly: ")
            and f"(rank {r}/{WORLD_SIZE}, 2 workers)" in line
            for line in lines
        ), proc.stdout
        assert (tmp_path / f"c.pt.rank{r}").stat().st_size > 0
