"""``LoaderConfig(pin_memory=True)``: pinned outputs, off the consumer's thread,
with delivery and checkpoints unchanged; without an accelerator, one warning."""

from __future__ import annotations

import collections
import dataclasses
import threading
import warnings
from typing import Any

import pytest
import torch

import centralpipe as cp
from centralpipe.dispatch import pinning
from centralpipe.testing import assert_resumes_exactly
from tests._configs import loader_config

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Batch:
    x: Any
    n: int


class Marked:
    """A value with its own ``pin_memory()`` (as custom batch types have)."""

    def __init__(self, value: Any, pinned: bool = False) -> None:
        self.value = value
        self.pinned = pinned

    def pin_memory(self) -> Marked:
        return Marked(self.value, pinned=True)


def _config(num_workers: int, pin_memory: bool) -> cp.LoaderConfig:
    base = loader_config(num_workers=num_workers, chunk_size=4, buffer_size=32)
    return cp.LoaderConfig(workers=base.workers, seed=base.seed, pin_memory=pin_memory)


def _pipe(n: int = 50) -> cp.Pipeline:
    return cp.Pipeline.from_iterable(range(n)).dispatch().map(_tensor_of)


def _tensor_of(i: int) -> torch.Tensor:
    return torch.full((3,), float(i))


def test_pin_memory_is_validated_and_round_trips() -> None:
    """pin_memory must be a bool; to_dict/from_dict keep it."""
    assert cp.LoaderConfig().pin_memory is False
    config = cp.LoaderConfig(pin_memory=True)
    assert cp.LoaderConfig.from_dict(config.to_dict()).pin_memory is True
    with pytest.raises(cp.ConfigError, match="pin_memory"):
        cp.LoaderConfig(pin_memory=1)  # type: ignore[arg-type]
    with pytest.raises(cp.ConfigError, match="pin_memory"):
        cp.LoaderConfig.from_dict({"pin_memory": "yes"})


@pytest.mark.skipif(pinning.accelerator() is not None, reason="an accelerator is present")
@pytest.mark.parametrize("num_workers", [0, 2], ids=["inline", "2-workers"])
def test_without_accelerator_warns_once_and_changes_nothing(num_workers: int) -> None:
    """No accelerator: one RuntimeWarning per Loader, outputs as without pinning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cp.Loader(_pipe(), _config(num_workers, pin_memory=True)) as loader:
            first = [t.tolist() for t in loader]
            second = [t.tolist() for t in loader]
    pin_warnings = [w for w in caught if "pin_memory" in str(w.message)]
    assert len(pin_warnings) == 1
    assert pin_warnings[0].category is RuntimeWarning
    assert first == second == [[float(i)] * 3 for i in range(50)]


def test_pin_walks_containers() -> None:
    """pin() rebuilds lists, tuples, namedtuples, dicts and dataclasses and
    calls an object's own pin_memory()."""
    item = {"a": [Marked(1), (Marked(2), "s")], "p": Pair(Marked(3), 4), "b": Batch(Marked(5), 6)}
    out = pinning.pin(item)
    assert out["a"][0].pinned and out["a"][1][0].pinned and out["a"][1][1] == "s"
    assert isinstance(out["p"], Pair) and out["p"].a.pinned and out["p"].b == 4
    assert isinstance(out["b"], Batch) and out["b"].x.pinned and out["b"].n == 6
    assert not item["a"][0].pinned  # the input is not changed


def _fake_pin(obj: Any) -> Any:
    """Stands in for pinning on a machine without an accelerator: records the
    thread and wraps the item."""
    return ("pinned", threading.current_thread().name, obj)


@pytest.mark.parametrize("num_workers", [0, 2], ids=["inline", "2-workers"])
def test_outputs_are_pinned_by_the_pin_thread(
    monkeypatch: pytest.MonkeyPatch, num_workers: int
) -> None:
    """With an accelerator, every output is pinned, in order, by the pin thread
    (not the consumer); checkpoints resume exactly."""
    monkeypatch.setattr(pinning, "accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(pinning, "pin", _fake_pin)
    pipe = cp.Pipeline.from_iterable(range(30)).dispatch().map(lambda x: x * 2)
    config = _config(num_workers, pin_memory=True)
    with cp.Loader(pipe, config) as loader:
        out = list(loader)
    assert [x for _, _, x in out] == [2 * i for i in range(30)]
    assert {tag for tag, _, _ in out} == {"pinned"}
    assert {thread for _, thread, _ in out} == {"centralpipe-pin"}
    assert_resumes_exactly(pipe, config, ks=[0, 5, 13, 29])


@pytest.mark.skipif(pinning.accelerator() is None, reason="needs an accelerator")
def test_tensors_are_pinned_on_an_accelerator() -> None:
    """On a machine with an accelerator, delivered tensors are pinned."""
    with cp.Loader(_pipe(10), _config(2, pin_memory=True)) as loader:
        assert all(t.is_pinned() for t in loader)
