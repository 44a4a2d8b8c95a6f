"""``LoaderConfig(pin_memory=True)``: pinned outputs, off the consumer's thread,
with delivery and checkpoints unchanged; without an accelerator, one warning."""

from __future__ import annotations

import collections
import dataclasses
import sys
import threading
import warnings
from typing import Any

import pytest
import torch

import centralpipe as cp
from centralpipe.dispatch import pinning
from centralpipe.testing import assert_resumes_exactly
from tests.support.configs import loader_config

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
    """No accelerator: one RuntimeWarning per Loader (at its creation, for the
    caller's line, not again per epoch), outputs as without pinning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cp.Loader(_pipe(), _config(num_workers, pin_memory=True)) as loader:
            first = [t.tolist() for t in loader]
            second = [t.tolist() for t in loader]
    pin_warnings = [w for w in caught if "pin_memory" in str(w.message)]
    assert len(pin_warnings) == 1
    assert pin_warnings[0].category is RuntimeWarning
    assert pin_warnings[0].filename == __file__  # points at the Loader(...) line
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


class FakeAccelerator:
    """A CUDA device 3 faked through the public APIs the pinning code calls
    (``torch.accelerator``, ``Tensor.pin_memory``, ``Tensor.is_pinned``), so
    the accelerator path runs on a machine without one. A "pinned" tensor is
    a clone whose storage address is recorded (and kept alive, so no address
    is reused); each pin records the thread that made it."""

    DEVICE_INDEX = 3

    def __init__(self, monkeypatch: pytest.MonkeyPatch, kind: str = "cuda") -> None:
        self.pinned: dict[int, torch.Tensor] = {}
        self.pin_threads: list[str] = []
        self.device_set: list[tuple[str, int]] = []
        acc = torch.accelerator
        monkeypatch.setattr(acc, "is_available", lambda: True)
        monkeypatch.setattr(acc, "current_accelerator", lambda *a, **k: torch.device(kind))
        monkeypatch.setattr(acc, "current_device_index", lambda: self.DEVICE_INDEX)
        monkeypatch.setattr(acc, "set_device_index", self._set_device_index)
        pinned, pin_threads = self.pinned, self.pin_threads

        def pin_memory(t: torch.Tensor, *args: Any) -> torch.Tensor:
            assert not args, "the device argument of pin_memory() is deprecated"
            out = t.clone()
            pinned[out.untyped_storage().data_ptr()] = out
            pin_threads.append(threading.current_thread().name)
            return out

        # Plain functions: as class attributes they bind to the tensor.
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t, *a: self.is_pinned(t))

    def _set_device_index(self, index: int) -> None:
        self.device_set.append((threading.current_thread().name, index))

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.pinned


#: A tensor the stage returns that is pinned already (set by the test).
_ALREADY: list[torch.Tensor] = []


def _nested(i: int) -> Any:
    """A worker stage's result with tensors in every container kind pin() walks."""
    t = torch.full((4,), float(i))
    return {
        "list": [t, (t + 1, "s")],
        "pair": Pair(t + 2, i),
        "batch": Batch(t + 3, i),
        "marked": Marked(i),
        "plain": i,
        "already": _ALREADY[0] if _ALREADY else None,
    }


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    return []


@pytest.mark.parametrize("num_workers", [0, 2], ids=["inline", "2-workers"])
def test_fake_accelerator_pins_every_tensor_in_the_pin_thread(
    monkeypatch: pytest.MonkeyPatch, num_workers: int
) -> None:
    """On a (faked) accelerator every tensor of every delivered item is
    pinned, in containers of every kind, by the pin thread set to the
    Loader's device (not the consumer); a tensor already pinned is not
    pinned again; values, order and checkpoints are unchanged; no warning."""
    fake = FakeAccelerator(monkeypatch)
    already = torch.arange(3.0).pin_memory()
    monkeypatch.setattr(sys.modules[__name__], "_ALREADY", [already])
    fake.pin_threads.clear()
    pipe = cp.Pipeline.from_iterable(range(20)).dispatch().map(_nested)
    config = _config(num_workers, pin_memory=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with cp.Loader(pipe, config) as loader:
            out = list(loader)
    assert len(out) == 20
    for i, item in enumerate(out):
        assert isinstance(item["list"], list) and isinstance(item["list"][1], tuple)
        assert isinstance(item["pair"], Pair) and isinstance(item["batch"], Batch)
        assert item["marked"].pinned and item["plain"] == i and item["list"][1][1] == "s"
        tensors = _tensors(item)
        assert len(tensors) == 5
        assert all(fake.is_pinned(t) for t in tensors), i
        assert torch.equal(item["batch"].x, torch.full((4,), i + 3.0))
        if num_workers == 0:  # the same object: not pinned again
            assert item["already"] is already
    pins = 4 * 20 + (20 if num_workers else 0)  # with workers "already" is a fresh copy
    assert len(fake.pin_threads) == pins
    assert set(fake.pin_threads) == {"centralpipe-pin"}
    assert ("centralpipe-pin", FakeAccelerator.DEVICE_INDEX) in fake.device_set
    assert all(name == "centralpipe-pin" for name, _ in fake.device_set)
    assert_resumes_exactly(pipe.map(_tensors), config, ks=[0, 5, 13, 19])


def test_fake_mps_accelerator_warns_and_pins_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """On MPS torch cannot pin memory: one warning naming it, nothing pinned,
    items unchanged (as torch's DataLoader does)."""
    fake = FakeAccelerator(monkeypatch, kind="mps")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cp.Loader(_pipe(10), _config(2, pin_memory=True)) as loader:
            out = [t.tolist() for t in loader]
    assert [str(w.message) for w in caught if "pin_memory" in str(w.message)] == [
        "LoaderConfig(pin_memory=True) but torch cannot pin memory for the 'mps' "
        "accelerator: tensors are not pinned."
    ]
    assert out == [[float(i)] * 3 for i in range(10)]
    assert not fake.pin_threads


def _fake_pin(obj: Any) -> Any:
    """Stands in for pinning: records the thread and wraps the item."""
    return ("pinned", threading.current_thread().name, obj)


@pytest.mark.parametrize("num_workers", [0, 2], ids=["inline", "2-workers"])
def test_outputs_are_pinned_by_the_pin_thread(
    monkeypatch: pytest.MonkeyPatch, num_workers: int
) -> None:
    """With an accelerator, every output (of any type) is pinned, in order, by
    the pin thread (not the consumer); checkpoints resume exactly."""
    FakeAccelerator(monkeypatch)
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


def _fails_on_five(obj: Any) -> Any:
    """pin() that fails for the output 5.0 (as running out of pinned memory would)."""
    if isinstance(obj, torch.Tensor) and float(obj[0]) == 5.0:
        raise RuntimeError("out of pinned memory (fake)")
    return obj


@pytest.mark.parametrize("num_workers", [0, 2], ids=["inline", "2-workers"])
def test_a_failure_to_pin_is_raised_once_and_the_checkpoint_resumes(
    monkeypatch: pytest.MonkeyPatch, num_workers: int
) -> None:
    """A pin that fails is raised once, as itself with a note naming
    pin_memory and the item; the iterator then ends (it raised the same
    error forever); the checkpoint taken then resumes at the first item not
    delivered."""
    FakeAccelerator(monkeypatch)
    monkeypatch.setattr(pinning, "pin", _fails_on_five)
    config = _config(num_workers, pin_memory=True)
    with cp.Loader(_pipe(10), config) as loader:
        it = iter(loader)
        head = []
        with pytest.raises(RuntimeError, match="out of pinned memory") as info:
            for _ in range(10):
                head.append(float(next(it)[0]))
        assert any("pin_memory" in note for note in info.value.__notes__)
        with pytest.raises(StopIteration):
            next(it)
        state = loader.state_dict()
    assert head == [0.0, 1.0, 2.0, 3.0]  # chunks of 4: item 5's chunk is 4-7
    with cp.Loader(_pipe(10), _config(num_workers, pin_memory=False)) as loader:
        loader.load_state_dict(state)
        assert [float(t[0]) for t in loader] == [float(i) for i in range(4, 10)]
