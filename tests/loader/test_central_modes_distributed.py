"""``central="service"`` under torchrun: two ranks (gloo on loopback), each
with its own service, give what ``"process"`` gives and resume across modes.

The ranks run ``tests/scripts/dist_modes.py`` (one launch for every check) and write
what they saw; the assertions are made here, on both ranks' files together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.torchrun import RUN_TIMEOUT_S, rank_results

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "dist_modes.py"
N = 41  # as in dist_modes.py
STEP = 7
WORLD_SIZE = 2

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each rank of one torchrun launch of ``dist_modes.py`` wrote."""
    return rank_results(SCRIPT, tmp_path_factory.mktemp("modes"), nproc=WORLD_SIZE)


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_every_rank_gets_the_same_batches_in_both_modes(ranks: list[dict[str, Any]]) -> None:
    """Each rank's shard in ``"service"`` equals its shard in ``"process"``;
    together the ranks hold N // 2 * 2 distinct items (drop_last)."""
    for result in ranks:
        assert result["full"]["service"] == result["full"]["process"]
        assert len(result["full"]["process"]) == N // WORLD_SIZE
    together = ranks[0]["full"]["process"] + ranks[1]["full"]["process"]
    assert len(set(together)) == len(together) == N // WORLD_SIZE * WORLD_SIZE


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_states_are_the_same_per_rank_format_in_both_modes(ranks: list[dict[str, Any]]) -> None:
    """After the same step a rank's state has the same keys in both modes, and
    the ranks' states merge (``merge_states``) into a state that resumes on one
    rank, in either mode, with every item the two ranks had not delivered."""
    all_items = sorted(x * x + 1 for x in range(N))
    for result in ranks:
        assert result["keys"]["service"] == result["keys"]["process"]
        assert "format_version" in result["keys"]["process"]
        merged = result["merged"]["service"]
        assert merged == result["merged"]["process"] == ranks[0]["merged"]["process"]
        heads = ranks[0]["head"]["service"] + ranks[1]["head"]["service"]
        assert sorted(heads + merged) == all_items


@pytest.mark.parametrize(
    "pair",
    ["process-to-process", "process-to-service", "service-to-process", "service-to-service"],
)
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_a_rank_resumes_exactly_across_modes(ranks: list[dict[str, Any]], pair: str) -> None:
    """The first STEP items plus the rest resumed in any mode from a state saved
    in any mode equal the uninterrupted shard."""
    for result in ranks:
        saved = pair.split("-to-")[0]
        assert result["head"][saved] + result["resumed"][pair] == result["full"]["process"]


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_the_socket_directory_is_keyed_by_the_job(ranks: list[dict[str, Any]]) -> None:
    """Under torchrun the services' directory is named after the run id,
    the same for the job's ranks."""
    dirs = {result["socket_dir"] for result in ranks}
    assert len(dirs) == 1 and next(iter(dirs)).split("-", 2)[2].startswith("job-")
