"""The resume property on random pipelines: first k items + resumed rest == full run."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import centralpipe as cp
from centralpipe.testing import _torch_roundtrip, assert_resumes_exactly
from tests.support.configs import loader_config

# -- stage functions: module level (picklable), defined for ints and nested lists ---


def _value(x: Any) -> int:
    return x if isinstance(x, int) else sum(_value(y) for y in x)


def _plus1(x: Any) -> Any:
    return x + 1 if isinstance(x, int) else [_plus1(y) for y in x]


def _keep(x: Any) -> bool:
    return _value(x) % 3 != 0


def _spread(x: Any) -> list[Any]:
    """Ints become 0, 1 or 2 copies; lists are unbatched."""
    return [x] * (x % 3) if isinstance(x, int) else list(x)


def _size(x: Any) -> int:
    return _value(x) % 5 if isinstance(x, int) else len(x)


FUNCTIONS = {"map": _plus1, "filter": _keep, "flat_map": _spread}


@st.composite
def central_stage(draw: st.DrawFn, pipe: cp.Pipeline) -> cp.Pipeline:
    kind = draw(
        st.sampled_from(
            ["map", "filter", "flat_map", "batch", "shuffle", "count", "bucket_by_max_tokens"]
        )
    )
    if kind in FUNCTIONS:
        return getattr(pipe, kind)(FUNCTIONS[kind])
    if kind == "batch":
        return pipe.batch(draw(st.integers(1, 4)), drop_last=draw(st.booleans()))
    if kind == "shuffle":
        return pipe.shuffle(draw(st.integers(1, 8)))
    if kind == "count":
        return pipe.count(weight_fn=draw(st.sampled_from([None, _size])))
    return pipe.bucket_by_max_tokens(
        draw(st.integers(1, 10)),
        len_fn=_size,
        buffer_size=draw(st.one_of(st.none(), st.integers(1, 6))),
        include_padding=draw(st.booleans()),
    )


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[cp.Pipeline, cp.DistributedConfig]:
    """A list source, 0-4 central stages, an optional shard, optional dispatch and
    0-2 worker stages; with the distributed config the shard needs."""
    pipe = cp.Pipeline.from_iterable(draw(st.lists(st.integers(0, 20), max_size=30)))
    for _ in range(draw(st.integers(0, 4))):
        pipe = draw(central_stage(pipe))
    dist = cp.DistributedConfig()
    if draw(st.booleans()) and draw(st.booleans()):
        world_size = draw(st.integers(1, 3))
        dist = cp.DistributedConfig(
            rank=draw(st.integers(0, world_size - 1)), world_size=world_size
        )
        pipe = pipe.shard(equalize=draw(st.sampled_from([None, "drop_last", "pad"])))
    if draw(st.booleans()):
        pipe = pipe.dispatch()
        for _ in range(draw(st.integers(0, 2))):
            kind = draw(st.sampled_from(sorted(FUNCTIONS)))
            pipe = getattr(pipe, kind)(FUNCTIONS[kind])
    note(pipe.describe())
    return pipe, dist


def _config(dist: cp.DistributedConfig, **kw: Any) -> cp.LoaderConfig:
    return loader_config(rank=dist.rank, world_size=dist.world_size, **kw)


def _ks(data: st.DataObject, pipe: cp.Pipeline, config: cp.LoaderConfig, epochs: int) -> list[int]:
    with cp.Loader(pipe, config) as loader:
        n = sum(len(list(loader)) for _ in range(epochs))
    ks = data.draw(st.lists(st.integers(0, n), min_size=1, max_size=3, unique=True), label="ks")
    return sorted(ks)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    built=pipelines(),
    buffer_size=st.sampled_from([1, 2, 5, None]),
    chunk_size=st.sampled_from([None, 1, 3]),
    seed=st.integers(0, 3),
    epochs=st.integers(1, 2),
    data=st.data(),
)
def test_resume_is_exact_inline(
    built: tuple[cp.Pipeline, cp.DistributedConfig],
    buffer_size: int | None,
    chunk_size: int | None,
    seed: int,
    epochs: int,
    data: st.DataObject,
) -> None:
    """Any pipeline, any k, inline: head + resumed rest equals the uninterrupted run."""
    pipe, dist = built
    config = _config(dist, num_workers=0, buffer_size=buffer_size, chunk_size=chunk_size, seed=seed)
    assert_resumes_exactly(pipe, config, ks=_ks(data, pipe, config, epochs), epochs=epochs)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    built=pipelines(),
    buffer_size=st.sampled_from([1, 4, None]),
    chunk_size=st.sampled_from([None, 1, 2]),
    resume_workers=st.sampled_from([0, 2]),
    data=st.data(),
)
def test_resume_is_exact_with_workers(
    built: tuple[cp.Pipeline, cp.DistributedConfig],
    buffer_size: int | None,
    chunk_size: int | None,
    resume_workers: int,
    data: st.DataObject,
) -> None:
    """Any pipeline, any k, with 2 forked workers (resumed with 0 or 2): same property."""
    pipe, dist = built
    config = _config(dist, num_workers=2, buffer_size=buffer_size, chunk_size=chunk_size, seed=1)
    resume = _config(
        dist, num_workers=resume_workers, buffer_size=buffer_size, chunk_size=chunk_size, seed=1
    )
    assert_resumes_exactly(pipe, config, resume_config=resume, ks=_ks(data, pipe, config, 1))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(built=pipelines(), buffer_size=st.sampled_from([1, 3, None]), data=st.data())
def test_resume_of_a_resumed_run_is_exact(
    built: tuple[cp.Pipeline, cp.DistributedConfig],
    buffer_size: int | None,
    data: st.DataObject,
) -> None:
    """Resume at k1, take k2 more, checkpoint again: the second resume is exact too."""
    pipe, dist = built
    config = _config(dist, num_workers=0, buffer_size=buffer_size, chunk_size=None, seed=2)
    with cp.Loader(pipe, config) as loader:
        full = list(loader)
    k1 = data.draw(st.integers(0, len(full)), label="k1")
    k2 = data.draw(st.integers(0, len(full) - k1), label="k2")
    with cp.Loader(pipe, config) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(k1)]
        state = _torch_roundtrip(loader.state_dict())
    with cp.Loader(pipe, config) as loader:
        loader.load_state_dict(state)
        it = iter(loader)
        middle = [next(it) for _ in range(k2)]
        state = _torch_roundtrip(loader.state_dict())
    with cp.Loader(pipe, config) as loader:
        loader.load_state_dict(state)
        assert head + middle + list(loader) == full
