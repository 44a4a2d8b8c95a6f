"""Numbers users' functions return: `len_fn` (`bucket_by_max_tokens`, `pack`) and
`weight_fn` (`count`) of any numeric type become Python numbers at the stage, so
the state holds only builtins, loads with `weights_only=True` and resumes
exactly; anything that is not a length or a weight is a `PipelineError` at once,
naming the stage."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

import centralpipe as cp
from centralpipe.testing import assert_resumes_exactly, collect
from tests.support.configs import loader_config

#: A feeder that reads little ahead, so checkpoints hold the stages' buffers.
LOCKSTEP = loader_config(buffer_size=2, chunk_size=1)
LENGTHS = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 2, 4, 1, 3, 2, 6, 4, 1, 2, 3]

Num = Callable[[int], Any]

#: Integer kinds a `len_fn` may return (each makes the Python int n).
INT_KINDS: dict[str, Num] = {
    "int": int,
    "numpy-int64": np.int64,
    "numpy-int32": np.int32,
    "numpy-uint8": np.uint8,
    "tensor-0d-int64": torch.tensor,
    "tensor-0d-int32": lambda n: torch.tensor(n, dtype=torch.int32),
    "tensor-one-element": lambda n: torch.tensor([n]),
    "mask-sum": lambda n: torch.ones(n, dtype=torch.bool).sum(),
}
#: Kinds a `weight_fn` may return: the integer kinds, and floats (n / 2 is exact).
WEIGHT_KINDS: dict[str, Num] = {
    **INT_KINDS,
    "float": lambda n: n / 2,
    "fraction": lambda n: Fraction(n, 2),
    "numpy-float64": lambda n: np.float64(n / 2),
    "numpy-float32": lambda n: np.float32(n / 2),
    "tensor-0d-float32": lambda n: torch.tensor(n / 2),
    "tensor-0d-float64": lambda n: torch.tensor(n / 2, dtype=torch.float64),
}


def _items() -> list[list[int]]:
    return [[i] * n for i, n in enumerate(LENGTHS)]


def _bucket(kind: Num) -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(_items())
        .bucket_by_max_tokens(8, len_fn=lambda x: kind(len(x)), buffer_size=5, name="b")
        .dispatch()
    )


def _pack(kind: Num) -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(_items())
        .pack(8, len_fn=lambda x: kind(len(x)), buffer_size=5, name="p")
        .dispatch()
    )


def _count(kind: Num) -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(_items())
        .count("c", weight_fn=lambda x: kind(len(x)))
        .batch(3)
        .dispatch()
    )


def _python_number(value: Any) -> Any:
    """The Python number a numpy scalar or one-element tensor stands for."""
    return value.item() if hasattr(value, "item") else value


def _weights_only(state: dict[str, Any]) -> Any:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _builtins_only(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_builtins_only(x) for x in value)
    if isinstance(value, dict):
        return all(_builtins_only(k) and _builtins_only(x) for k, x in value.items())
    return value is None or type(value) in (int, float, bool, str)


CASES = [
    pytest.param(build, kind, id=f"{stage}-{name}")
    for stage, build, kinds in [
        ("bucket", _bucket, INT_KINDS),
        ("pack", _pack, INT_KINDS),
        ("count", _count, WEIGHT_KINDS),
    ]
    for name, kind in kinds.items()
]


@pytest.mark.parametrize(("build", "kind"), CASES)
def test_numeric_kinds_give_builtin_state_that_resumes_exactly(
    build: Callable[[Num], cp.Pipeline], kind: Num
) -> None:
    """Every numeric kind gives the output of Python numbers, a state of builtins
    that `torch.load(weights_only=True)` reads, and an exact resume at every k."""
    pipe = build(kind)
    base = build(lambda n: _python_number(kind(n)))  # the same numbers as Python ones
    with cp.Loader(base, LOCKSTEP) as loader:
        expected = collect(loader)
    full = assert_resumes_exactly(pipe, LOCKSTEP)
    assert full == expected
    for k in (1, 3):
        with cp.Loader(pipe, LOCKSTEP) as loader:
            it = iter(loader)
            head = [next(it) for _ in range(k)]
            state = loader.state_dict()
        assert _builtins_only(state["central"]), state["central"]
        assert _builtins_only(state["in_flight"]["dispatch"]["stamps"])
        with cp.Loader(pipe, LOCKSTEP) as resumed:
            resumed.load_state_dict(_weights_only(state))
            assert head + collect(resumed) == expected


def test_bucket_state_holds_the_lengths_as_ints() -> None:
    """The bucket heap's lengths from numpy and tensor `len_fn`s are Python ints."""
    with cp.Loader(_bucket(INT_KINDS["mask-sum"]), LOCKSTEP) as loader:
        next(iter(loader))
        heap = loader.state_dict()["central"]["b"]["heap"]
    assert heap, "the checkpoint must hold buffered items"
    assert [type(length) for length, _, _ in heap] == [int] * len(heap)


@pytest.mark.parametrize(
    "kind",
    [torch.tensor, lambda n: torch.tensor(float(n)), np.int64, np.float64],
    ids=["tensor-int", "tensor-float", "numpy-int", "numpy-float"],
)
def test_count_delivered_totals_are_exact_and_share_nothing(kind: Num) -> None:
    """`query(delivered=True)` after 3 items of lengths 1, 2, 3 is weight 6 (a 0-d
    tensor weight was added in place, so every stamp saw the latest total)."""
    pipe = (
        cp.Pipeline.from_iterable([[0] * (i % 3 + 1) for i in range(6)])
        .count("c", weight_fn=lambda x: kind(len(x)))
        .dispatch()
    )
    with cp.Loader(pipe, loader_config(buffer_size=6, chunk_size=3)) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(3)]
        delivered = loader.query("c", delivered=True)
        rest = list(it)
        final = loader.query("c")
    assert [len(x) for x in head + rest] == [1, 2, 3, 1, 2, 3]
    assert delivered == {"items": 3, "weight": 6}
    assert final == {"items": 6, "weight": 12}
    assert type(delivered["weight"]) is type(final["weight"]) is type(_python_number(kind(1)))


BAD_LENGTHS: dict[str, Any] = {
    "nan": math.nan,
    "inf": math.inf,
    "negative": -1,
    "numpy-negative": np.int64(-2),
    "tensor-negative": torch.tensor(-3),
    "str": "3",
    "bool": True,
    "tensor-bool": torch.tensor(True),
    "numpy-bool": np.bool_(True),
    "float": 2.5,
    "integral-float": 3.0,
    "numpy-float": np.float64(3.0),
    "tensor-float": torch.tensor(3.0),
    "tensor-two-elements": torch.tensor([1, 2]),
    "none": None,
}


@pytest.mark.parametrize(
    ("stage", "build"), [("b", "bucket"), ("p", "pack")], ids=["bucket", "pack"]
)
@pytest.mark.parametrize("raw", list(BAD_LENGTHS.values()), ids=list(BAD_LENGTHS))
def test_bad_length_is_a_pipeline_error_naming_the_stage(stage: str, build: str, raw: Any) -> None:
    """A length that is not an int >= 0 is a `PipelineError` naming the stage and
    what it got, at the first item (NaN lengths once made one 40-item batch)."""
    src = cp.Pipeline.from_iterable(range(40))
    if build == "bucket":
        pipe = src.bucket_by_max_tokens(6, len_fn=lambda x: raw, name=stage)
    else:
        pipe = src.pack(6, len_fn=lambda x: raw, name=stage)
    got = repr(raw)[:20].replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    match = rf"stage '{stage}': len_fn must return an int >= 0 .*got {got}"
    with cp.Loader(pipe) as loader, pytest.raises(cp.PipelineError, match=match):
        next(iter(loader))


def test_nan_lengths_do_not_make_one_batch() -> None:
    """Under max_tokens=6, 40 items of NaN length are refused, not one 40-item batch."""
    pipe = cp.Pipeline.from_iterable(range(40)).bucket_by_max_tokens(6, len_fn=lambda x: math.nan)
    with cp.Loader(pipe) as loader, pytest.raises(cp.PipelineError, match="got nan"):
        collect(loader)


BAD_WEIGHTS: dict[str, Any] = {
    "nan": math.nan,
    "inf": math.inf,
    "minus-inf": -math.inf,
    "numpy-nan": np.float64("nan"),
    "tensor-nan": torch.tensor(math.nan),
    "str": "3",
    "bool": True,
    "numpy-bool": np.bool_(True),
    "tensor-bool": torch.tensor(True),
    "complex": 1 + 2j,
    "tensor-two-elements": torch.tensor([1.0, 2.0]),
    "none": None,
}


@pytest.mark.parametrize("raw", list(BAD_WEIGHTS.values()), ids=list(BAD_WEIGHTS))
def test_bad_weight_is_a_pipeline_error_naming_the_stage(raw: Any) -> None:
    """A weight that is not a finite number is a `PipelineError` naming the stage
    and the item; the items before it were counted."""
    pipe = cp.Pipeline.from_iterable(range(4)).count("c", weight_fn=lambda x: 1 if x < 2 else raw)
    match = r"stage 'c': weight_fn must return a finite number .*got .* for item 2 of this epoch"
    with cp.Loader(pipe, LOCKSTEP) as loader:
        it = iter(loader)
        assert [next(it), next(it)] == [0, 1]
        with pytest.raises(cp.PipelineError, match=match):
            next(it)
        assert loader.query("c") == {"items": 2, "weight": 2}
