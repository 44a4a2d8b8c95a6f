"""Configuration: validation naming the field, dict/TOML round trips, env ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import centralpipe as cp
from tests.support.configs import LAUNCHER_ENV_NAMES


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_workers": -1}, "num_workers"),
        ({"num_workers": 1.5}, "num_workers"),
        ({"num_workers": True}, "num_workers"),
        ({"num_workers": "2"}, "num_workers"),
        ({"buffer_size": 0}, "buffer_size"),
        ({"buffer_size": -3}, "buffer_size"),
        ({"buffer_size": "x"}, "buffer_size"),
        ({"buffer_size": 2.0}, "buffer_size"),
        ({"buffer_bytes": 0}, "buffer_bytes"),
        ({"buffer_bytes": -1}, "buffer_bytes"),
        ({"buffer_bytes": 1.5e9}, "buffer_bytes"),
        ({"buffer_bytes": True}, "buffer_bytes"),
        ({"buffer_bytes": "256MiB"}, "buffer_bytes"),
        ({"start_method": "bogus"}, "start_method"),
        ({"on_error": "ignore"}, "on_error"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": -1.0}, "timeout_s"),
        ({"timeout_s": True}, "timeout_s"),
        ({"timeout_s": "1"}, "timeout_s"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"chunk_size": 0}, "chunk_size"),
    ],
    ids=lambda v: repr(v) if not isinstance(v, str) else v,
)
def test_worker_config_rejects_bad_values(kwargs: dict[str, Any], field: str) -> None:
    """An invalid `WorkerConfig` value raises `ConfigError` quoting the field and value."""
    with pytest.raises(cp.ConfigError, match=f"`{field}` must be") as info:
        cp.WorkerConfig(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"world_size": 0}, "world_size"),
        ({"rank": -1}, "rank"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"rank": 1.0, "world_size": 2}, "rank"),
        ({"local_rank": -1}, "local_rank"),
    ],
    ids=["world_size=0", "rank=-1", "rank=world_size", "rank-float", "local_rank=-1"],
)
def test_distributed_config_rejects_bad_values(kwargs: dict[str, Any], field: str) -> None:
    """An invalid `DistributedConfig` value raises `ConfigError` naming the field."""
    with pytest.raises(cp.ConfigError, match=f"`{field}` must be"):
        cp.DistributedConfig(**kwargs)


def test_rank_error_names_the_allowed_range() -> None:
    """`rank >= world_size` says the allowed range `[0, world_size)`."""
    with pytest.raises(cp.ConfigError, match=r"\[0, 2\), got 2"):
        cp.DistributedConfig(rank=2, world_size=2)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seed": -1}, "seed"),
        ({"seed": "1"}, "seed"),
        ({"seed": True}, "seed"),
        ({"workers": {}}, "workers"),
        ({"distributed": cp.WorkerConfig()}, "distributed"),
    ],
    ids=["seed=-1", "seed-str", "seed-bool", "workers-dict", "distributed-wrong-class"],
)
def test_loader_config_rejects_bad_values(kwargs: dict[str, Any], field: str) -> None:
    """An invalid `LoaderConfig` value raises `ConfigError` naming the field."""
    with pytest.raises(cp.ConfigError, match=f"`{field}` must be"):
        cp.LoaderConfig(**kwargs)


def test_configs_are_frozen() -> None:
    """Configs are immutable: assigning a field raises."""
    import attrs

    config = cp.WorkerConfig()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.num_workers = 3  # type: ignore[misc]


def test_buffer_size_none_means_unlimited() -> None:
    """`buffer_size=None` and `"unlimited"` both mean no bound."""
    assert cp.WorkerConfig(buffer_size=None).buffer_size is None
    assert cp.WorkerConfig(buffer_size="unlimited").buffer_size is None  # type: ignore[arg-type]
    assert isinstance(cp.WorkerConfig().buffer_size, int)


def test_buffer_bytes_default_none_and_unlimited() -> None:
    """`buffer_bytes` defaults to 256 MiB; `None` and `"unlimited"` mean no bound."""
    assert cp.WorkerConfig().buffer_bytes == 256 * 2**20
    assert cp.WorkerConfig(buffer_bytes=None).buffer_bytes is None
    assert cp.WorkerConfig(buffer_bytes="unlimited").buffer_bytes is None  # type: ignore[arg-type]


CONFIGS = {
    "default": cp.LoaderConfig(),
    "full": cp.LoaderConfig(
        workers=cp.WorkerConfig(
            num_workers=3,
            buffer_size=None,
            buffer_bytes=1024,
            start_method="spawn",
            timeout_s=2.5,
            max_restarts=0,
            on_error="skip",
            chunk_size=8,
        ),
        distributed=cp.DistributedConfig(rank=1, world_size=3, local_rank=1),
        seed=42,
    ),
}


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_to_dict_from_dict_round_trip(config: cp.LoaderConfig) -> None:
    """`from_dict(to_dict())` gives back an equal config, via builtins only."""
    data = config.to_dict()
    assert isinstance(data, dict)
    assert isinstance(data["workers"], dict)
    assert isinstance(data["distributed"], dict)
    assert cp.LoaderConfig.from_dict(data) == config


def test_from_dict_missing_keys_take_defaults() -> None:
    """`from_dict` fills missing keys with the defaults."""
    config = cp.LoaderConfig.from_dict({"workers": {"num_workers": 2}})
    assert config == cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=2))


@pytest.mark.parametrize(
    ("data", "keys"),
    [
        ({"bogus": 1}, ["'bogus'"]),
        ({"workers": {"nope": 1, "zzz": 2}}, ["'nope'", "'zzz'"]),
        ({"distributed": {"ranks": 1}}, ["'ranks'"]),
    ],
    ids=["top", "workers", "distributed"],
)
def test_from_dict_unknown_keys_are_listed(data: dict[str, Any], keys: list[str]) -> None:
    """Unknown keys raise `ConfigError` listing each unknown key and the known ones."""
    with pytest.raises(cp.ConfigError, match="unknown key") as info:
        cp.LoaderConfig.from_dict(data)
    for key in keys:
        assert key in str(info.value)
    assert "known keys" in str(info.value)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"workers": {"num_workers": "3"}}, "num_workers"),
        ({"workers": {"buffer_size": "x"}}, "buffer_size"),
        ({"workers": {"timeout_s": "1"}}, "timeout_s"),
        ({"seed": "x"}, "seed"),
        ({"distributed": {"rank": 3, "world_size": 2}}, "rank"),
    ],
    ids=["num_workers-str", "buffer_size-str", "timeout_s-str", "seed-str", "rank-range"],
)
def test_from_dict_does_not_coerce_wrong_types(data: dict[str, Any], field: str) -> None:
    """`from_dict` hands raw values to the validators: `"3"` is not silently an int."""
    with pytest.raises(cp.ConfigError, match=f"`{field}` must be"):
        cp.LoaderConfig.from_dict(data)


def test_from_dict_needs_a_mapping() -> None:
    """`from_dict` of a non-mapping raises `ConfigError`."""
    with pytest.raises(cp.ConfigError, match="mapping"):
        cp.LoaderConfig.from_dict([1, 2])  # type: ignore[arg-type]


def test_from_toml(tmp_path: Path) -> None:
    """`from_toml` reads the tables; `buffer_size = "unlimited"` means `None`."""
    path = tmp_path / "loader.toml"
    path.write_text(
        'seed = 3\n\n[workers]\nnum_workers = 2\nbuffer_size = "unlimited"\n'
        'start_method = "fork"\n\n[distributed]\nrank = 1\nworld_size = 2\n'
    )
    config = cp.LoaderConfig.from_toml(path)
    assert config == cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=2, buffer_size=None, start_method="fork"),
        distributed=cp.DistributedConfig(rank=1, world_size=2),
        seed=3,
    )


def test_from_toml_invalid_value_names_the_field(tmp_path: Path) -> None:
    """A bad value in a TOML file raises `ConfigError` naming the field."""
    path = tmp_path / "loader.toml"
    path.write_text("[workers]\nnum_workers = -2\n")
    with pytest.raises(cp.ConfigError, match="`num_workers` must be an int >= 0, got -2"):
        cp.LoaderConfig.from_toml(str(path))


def test_from_toml_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    """A TOML file in another encoding raises `ConfigError` naming the file and the byte."""
    path = tmp_path / "latin1.toml"
    path.write_bytes("# caf\u00e9\nseed = 1\n".encode("latin-1"))
    with pytest.raises(cp.ConfigError, match=r"latin1\.toml: not valid TOML: TOML files are UTF-8"):
        cp.LoaderConfig.from_toml(str(path))


@pytest.mark.parametrize("seed", [2**64, 2**64 + 3, 2**100], ids=["2**64", "2**64+3", "2**100"])
def test_seed_beyond_64_bits_is_refused(seed: int) -> None:
    """A seed that would repeat a smaller seed's streams (`2**64` mixes as 0) is refused."""
    with pytest.raises(cp.ConfigError, match=r"`seed` must be an int in \[0, 2\*\*64\), got "):
        cp.LoaderConfig(seed=seed)


def test_largest_seed_gives_its_own_shuffle() -> None:
    """`seed=2**64 - 1` is accepted and shuffles differently from `seed=0` and `seed=1`."""
    pipe = cp.Pipeline.from_iterable(range(50)).shuffle(50)
    orders = []
    for seed in (0, 1, 2**64 - 1):
        with cp.Loader(pipe, cp.LoaderConfig(seed=seed)) as loader:
            orders.append(list(loader))
    assert len({tuple(o) for o in orders}) == 3


def test_from_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    """A file that is not TOML raises `ConfigError` naming the file."""
    path = tmp_path / "broken.toml"
    path.write_text("seed = [\n")
    with pytest.raises(cp.ConfigError, match=r"broken\.toml: not valid TOML"):
        cp.LoaderConfig.from_toml(path)


ENV_NAMES = LAUNCHER_ENV_NAMES


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (0, 1, None)),
        ({"RANK": "1", "WORLD_SIZE": "4"}, (1, 4, None)),
        ({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, (2, 4, 0)),
        ({"LOCAL_RANK": "1"}, (0, 1, 1)),
        ({"RANK": "", "WORLD_SIZE": ""}, (0, 1, None)),
    ],
    ids=["none", "rank-world", "with-local-rank", "local-rank-only", "empty-strings"],
)
def test_from_env(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: tuple[int, int, int | None]
) -> None:
    """`from_env` reads torchrun's variables, and is rank 0 of 1 without them."""
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = cp.DistributedConfig.from_env()
    assert (config.rank, config.world_size, config.local_rank) == expected


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "1"}, "RANK=1 is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, "neither RANK nor LOCAL_RANK"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be an int, got 'x'"),
        ({"RANK": "5", "WORLD_SIZE": "2"}, "`rank` must be in"),
    ],
    ids=["rank-only", "world-size-only", "not-an-int", "rank-too-large"],
)
def test_from_env_rejects_inconsistent_env(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], match: str
) -> None:
    """Half a RANK/WORLD_SIZE pair, a non-int, or rank >= world size is a `ConfigError`."""
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(cp.ConfigError, match=match):
        cp.DistributedConfig.from_env()


def test_resolved_start_method() -> None:
    """An explicit start method is kept; the default is forkserver or spawn."""
    assert cp.WorkerConfig(start_method="fork").resolved_start_method() == "fork"
    assert cp.WorkerConfig().resolved_start_method() in ("forkserver", "spawn")


def test_from_dict_section_of_wrong_type_names_it() -> None:
    """A section that is not a table says so, naming the section."""
    with pytest.raises(cp.ConfigError, match="`workers` must be a table"):
        cp.LoaderConfig.from_dict({"workers": 5})


def test_from_env_prefers_the_process_group_and_rejects_conflicts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An initialised process group wins; RANK/WORLD_SIZE that disagree with it
    are a ConfigError naming both."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key in ENV_NAMES:
        monkeypatch.delenv(key, raising=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        assert cp.DistributedConfig.from_env() == cp.DistributedConfig(rank=0, world_size=1)
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(cp.ConfigError, match=r"rank 0 of 1.*1 of 2"):
            cp.DistributedConfig.from_env()
    finally:
        dist.destroy_process_group()
