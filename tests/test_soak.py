"""A short soak: random kills, raises, damaged checkpoints and resumes lose
nothing and leak nothing (the interrupts run in the full soak)."""

from __future__ import annotations

import re

import pytest

from centralpipe import soak


@pytest.mark.timeout(180)
def test_short_soak_loses_and_duplicates_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """Ten seconds of chaos without interrupts (see docs/reliability.md, soak):
    0 lost, 0 duplicated, damaged checkpoints refused, no problem, no leaked
    fds, processes or threads."""
    assert soak.main(["--minutes", "0.15", "--seed", "1", "--no-interrupts"]) == 0
    out = capsys.readouterr().out
    assert "items lost      : 0" in out
    assert "duplicates      : 0" in out
    assert "problems        : 0" in out
    refused = re.search(r"damaged ckpts   : (\d+) refused", out)
    assert refused is not None and int(refused.group(1)) > 0, out
    assert "soak: PASS" in out
