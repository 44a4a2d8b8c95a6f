"""A short soak: random kills, raises, interrupts (Ctrl-C in ``next()``,
``state_dict()`` and ``close()``), damaged checkpoints and resumes lose
nothing and leak nothing."""

from __future__ import annotations

import re

import pytest

from centralpipe.tools import soak

#: Epochs the short soak runs (a fixed amount of work, whatever the load);
#: --minutes is only a bound on a run that has become slow.
EPOCHS = 8


@pytest.mark.timeout(300)
def test_short_soak_loses_and_duplicates_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """Eight epochs of chaos with interrupts (see docs/reliability.md, soak):
    all eight run, workers were killed from outside and from inside,
    interrupts landed in next(), state_dict() and close() and surfaced as
    KeyboardInterrupt, damaged checkpoints were refused; 0 lost, 0 duplicated,
    no problem, no leaked fds, processes or threads."""
    assert soak.main(["--epochs", str(EPOCHS), "--minutes", "3", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"soak: [\d.]+ min, {EPOCHS} epochs, seed 1\n", out), out
    assert "items lost      : 0" in out
    assert "duplicates      : 0" in out
    assert "problems        : 0" in out
    kills = re.search(r"kills           : (\d+) from outside, (\d+) from inside", out)
    assert kills is not None and all(int(n) > 0 for n in kills.groups()), out
    landed = re.search(
        r"interrupts      : iter (\d+) landed .*state_dict (\d+) landed .*close (\d+) landed", out
    )
    assert landed is not None and all(int(n) > 0 for n in landed.groups()), out
    refused = re.search(r"damaged ckpts   : (\d+) refused", out)
    assert refused is not None and int(refused.group(1)) > 0, out
    assert "soak: PASS" in out


def test_soak_refuses_a_bad_epoch_count(capsys: pytest.CaptureFixture[str]) -> None:
    """--epochs takes an int >= 1: 0, a negative or a word is a usage error naming it."""
    for bad in ("0", "-3", "two"):
        with pytest.raises(SystemExit) as exc:
            soak.main(["--epochs", bad])
        assert exc.value.code == 2
        assert (
            f"--epochs: expected an int >= 1 (epochs to run), got '{bad}'"
            in capsys.readouterr().err
        )
