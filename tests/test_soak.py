"""A short soak: random kills, raises, interrupts, damaged checkpoints and
resumes lose nothing and leak nothing."""

from __future__ import annotations

import re

import pytest

from centralpipe import soak


@pytest.mark.timeout(180)
def test_short_soak_loses_and_duplicates_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """Ten seconds of chaos: 0 lost, 0 duplicated, interrupts landed in the
    loader's calls, damaged checkpoints refused, no problem, no leaked fds,
    processes or threads."""
    assert soak.main(["--minutes", "0.15", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "items lost      : 0" in out
    assert "duplicates      : 0" in out
    assert "problems        : 0" in out
    landed = re.search(
        r"interrupts      : iter (\d+) landed .*state_dict (\d+) landed .*close (\d+)", out
    )
    assert landed is not None and sum(int(n) for n in landed.groups()) > 0, out
    refused = re.search(r"damaged ckpts   : (\d+) refused", out)
    assert refused is not None and int(refused.group(1)) > 0, out
    assert "soak: PASS" in out
