"""``central="node"`` under torchrun: two local ranks (gloo on loopback) share
one service per Loader; each rank gets what ``"process"`` gives it, resumes
exactly across modes, and sees a killed service, a killed local rank or a
stalled local rank as a clear error.

The ranks run ``tests/scripts/dist_node.py`` (one launch for every check) and write
what they saw; the assertions are made here, on both ranks' files together.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.torchrun import RUN_TIMEOUT_S, rank_results

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "dist_node.py"
N = 41  # as in dist_node.py
STEP = 7
WORLD_SIZE = 2

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(RUN_TIMEOUT_S + 30)]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("node")


@pytest.fixture(scope="module")
def ranks(out: Path) -> list[dict[str, Any]]:
    """What each rank of one torchrun launch of ``dist_node.py`` wrote."""
    return rank_results(SCRIPT, out, nproc=WORLD_SIZE)


def test_every_rank_gets_its_process_mode_batches(ranks: list[dict[str, Any]]) -> None:
    """Each rank's two epochs in ``"node"`` equal its two epochs in ``"process"``,
    N // 2 items each (drop_last), the ranks' items distinct."""
    for result in ranks:
        assert result["full"]["node"] == result["full"]["process"]
        assert [len(e) for e in result["full"]["node"]] == [N // WORLD_SIZE] * 2
    together = ranks[0]["full"]["node"][0] + ranks[1]["full"]["node"][0]
    assert len(set(together)) == len(together) == N // WORLD_SIZE * WORLD_SIZE


@pytest.mark.parametrize("equalize", ["None", "pad"], ids=["none", "pad"])
def test_uneven_and_padded_shards_equal_process_mode(
    ranks: list[dict[str, Any]], equalize: str
) -> None:
    """With ``equalize=None`` (21 and 20 items) and ``"pad"`` (21 each) each
    rank's epoch in ``"node"`` equals its epoch in ``"process"``."""
    sizes = {"None": [21, 20], "pad": [21, 21]}[equalize]
    for result, size in zip(ranks, sizes, strict=True):
        got = result["equalize"][equalize]
        assert got["node"] == got["process"]
        assert len(got["node"]) == size


@pytest.mark.parametrize(
    "pair", ["process-to-process", "process-to-node", "node-to-process", "node-to-node"]
)
def test_a_rank_resumes_exactly_across_modes(ranks: list[dict[str, Any]], pair: str) -> None:
    """The first STEP items plus the rest resumed in any mode from a state saved
    in any mode equal the uninterrupted shard."""
    saved = pair.split("-to-")[0]
    for result in ranks:
        assert result["head"][saved] + result["resumed"][pair] == result["full"]["process"][0]


def test_every_rank_queries_in_node_mode(ranks: list[dict[str, Any]]) -> None:
    """Mid-epoch, each local rank's ``query()`` and ``metrics()`` answer in
    ``"node"``: the count's delivered totals equal ``"process"``'s, its live
    totals (the shared count's last snapshot) are at least those and at most
    the epoch's, and a source's query and ``metrics()`` have the same keys."""
    for result in ranks:
        node, process = result["queries"]["node"], result["queries"]["process"]
        assert node["delivered"] == process["delivered"]
        assert node["delivered"]["items"] >= STEP
        live = node["live"]
        assert node["delivered"]["items"] <= live["items"] <= N
        assert live["weight"] == live["items"]
        assert node["source"] == process["source"]
        assert node["metrics"] == process["metrics"]


def test_node_states_merge_like_process_states(ranks: list[dict[str, Any]]) -> None:
    """The ranks' node-mode states merge (``merge_states``) into a state that
    resumes on one rank with exactly what the process-mode states' merge gives:
    every item the two ranks had not delivered."""
    all_items = sorted(x * x + 1 for x in range(N))
    for result in ranks:
        assert result["merged"]["node"] == result["merged"]["process"]
        heads = ranks[0]["head"]["node"] + ranks[1]["head"]["node"]
        assert sorted(heads + result["merged"]["node"]) == all_items


@pytest.mark.parametrize("saved", ["process", "node"])
def test_every_local_rank_resumes_one_gathered_state(
    ranks: list[dict[str, Any]], saved: str
) -> None:
    """``gather_states`` works in node mode, and every local rank loading the
    one global state (from either mode) resumes exactly its own shard's rest."""
    for result in ranks:
        assert result["head"][saved] + result["gathered"][saved] == result["full"]["process"][0]


@pytest.mark.parametrize("rank", [0, 1], ids=["rank0", "rank1"])
def test_inspect_reads_a_node_mode_state(ranks: list[dict[str, Any]], out: Path, rank: int) -> None:
    """``python -m centralpipe inspect`` summarises a node-mode state saved
    with ``torch.save`` like any per-rank state: its rank and world size."""
    proc = subprocess.run(
        [sys.executable, "-m", "centralpipe", "inspect", str(out / f"node-state-rank{rank}.pt")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"rank / world size: {rank} / {WORLD_SIZE}\n" in proc.stdout, proc.stdout
    assert f"delivered this epoch: {STEP} items\n" in proc.stdout


def test_the_service_and_its_workers_end_with_the_last_close(
    ranks: list[dict[str, Any]],
) -> None:
    """Once both local ranks closed their Loaders, neither the node's service
    nor any of its workers is alive (within 10 s)."""
    assert [result["left_alive"] for result in ranks] == [[], []]


def test_a_killed_service_is_an_error_on_both_ranks(ranks: list[dict[str, Any]]) -> None:
    """SIGKILL of the node's service: the next ``next()`` of each local rank
    raises ``ServiceError`` saying the service is gone."""
    assert ranks[0]["service_killed"].startswith("ServiceError: the central service of this Loader")
    assert "killed by that signal" in ranks[0]["service_killed"]
    assert ranks[1]["service_killed"].startswith("ServiceError: the central service of this node")


def test_a_killed_rank_is_an_error_naming_it(ranks: list[dict[str, Any]]) -> None:
    """SIGKILL of local rank 1's client: local rank 0's next ``next()`` raises
    ``ServiceError`` naming local rank 1."""
    assert ranks[1]["rank_killed"].startswith("child ready True")
    assert ranks[0]["rank_killed"].startswith("ServiceError: local rank 1 (pid ")
    assert "ended without closing its Loader" in ranks[0]["rank_killed"]


def test_a_stalled_rank_is_an_error_naming_it(ranks: list[dict[str, Any]]) -> None:
    """Local rank 1 stops reading: local rank 0 stops at the window's bound and,
    after the stall timeout, gets a ``ServiceError`` naming local rank 1."""
    assert ranks[0]["stalled"].startswith(
        "ServiceError: local rank 1 (global rank 1) has not read for 2.0 s"
    )
