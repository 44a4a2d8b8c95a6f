"""The public namespace and the exception hierarchy are pinned."""

from __future__ import annotations

import importlib

import pytest

import centralpipe as cp

PUBLIC_NAMES = [
    "CentralpipeError",
    "CheckpointError",
    "ConfigError",
    "DistributedConfig",
    "Loader",
    "LoaderConfig",
    "Pipeline",
    "PipelineError",
    "ServiceError",
    "Total",
    "WorkerConfig",
    "WorkerError",
    "gather_states",
    "merge_states",
    "progress",
]


def test_all_is_pinned_and_sorted() -> None:
    """`centralpipe.__all__` is exactly the documented, sorted list of names."""
    assert cp.__all__ == PUBLIC_NAMES
    assert cp.__all__ == sorted(cp.__all__)


@pytest.mark.parametrize("name", PUBLIC_NAMES, ids=str)
def test_every_public_name_is_importable(name: str) -> None:
    """Every name in `__all__` is an attribute of the package and `from`-importable."""
    module = importlib.import_module("centralpipe")
    assert getattr(module, name) is not None
    namespace: dict[str, object] = {}
    exec(f"from centralpipe import {name}", namespace)
    assert namespace[name] is getattr(cp, name)


def test_star_import_gives_exactly_all() -> None:
    """`from centralpipe import *` brings exactly the names of `__all__`."""
    namespace: dict[str, object] = {}
    exec("from centralpipe import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == PUBLIC_NAMES


def test_testing_helpers_are_importable() -> None:
    """`centralpipe.testing` offers the resume checker, its checkpoint step and `collect`."""
    from centralpipe import testing

    assert testing.__all__ == [
        "Checkpoint",
        "assert_resumes_exactly",
        "checkpoint_after",
        "collect",
        "items_until_interrupt",
    ]
    assert callable(testing.assert_resumes_exactly)
    assert callable(testing.collect)


@pytest.mark.parametrize(
    "error",
    [cp.PipelineError, cp.ConfigError, cp.CheckpointError, cp.WorkerError],
    ids=lambda e: e.__name__,
)
def test_every_error_subclasses_centralpipe_error(error: type[Exception]) -> None:
    """Every centralpipe exception is a `CentralpipeError`, itself an `Exception`."""
    assert issubclass(error, cp.CentralpipeError)
    assert issubclass(cp.CentralpipeError, Exception)


def test_config_error_is_a_value_error() -> None:
    """`ConfigError` is also a `ValueError`, so `except ValueError` catches bad values."""
    assert issubclass(cp.ConfigError, ValueError)
    with pytest.raises(ValueError, match="num_workers"):
        cp.WorkerConfig(num_workers=-1)


@pytest.mark.parametrize(
    "error",
    [cp.PipelineError, cp.CheckpointError, cp.WorkerError],
    ids=lambda e: e.__name__,
)
def test_other_errors_are_not_value_errors(error: type[Exception]) -> None:
    """Only `ConfigError` is a `ValueError`; the others are plain `CentralpipeError`s."""
    assert not issubclass(error, ValueError)


def test_worker_error_carries_its_attributes_through_pickle() -> None:
    """`WorkerError` keeps `stage`, `seq` and `remote_traceback` across pickling."""
    import pickle

    err = cp.WorkerError("boom", stage="map_3", seq=7, exc_type="KeyError", remote_traceback="tb")
    back = pickle.loads(pickle.dumps(err))
    assert (back.stage, back.seq, back.exc_type, back.remote_traceback) == (
        "map_3",
        7,
        "KeyError",
        "tb",
    )
    assert "Worker traceback:\ntb" in str(back)
