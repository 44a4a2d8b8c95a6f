"""Each per-item stage kind has one home (``plan.kinds``): typed options that
the spec carries, one length rule and one way to apply, looked up alike by
the builder, the inline and parallel nodes and the worker chain."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.dispatch.worker.chain import WorkerChain
from centralpipe.plan.kinds import (
    BATCHED_MAP,
    FILTER,
    FLAT_MAP,
    MAP,
    WORKER_KINDS,
    MapOptions,
    StageOptions,
    Total,
)
from centralpipe.plan.specs import StageSpec
from centralpipe.stages import (
    NODE_CLASSES,
    CentralNode,
    Filter,
    FlatMap,
    Map,
    Parallel,
    RunContext,
    build_central,
)


def _double(x: int) -> list[int]:
    return [x, x]


def _odd(x: int) -> bool:
    return x % 2 == 1


def _inc(x: int) -> int:
    return x + 1


def _incs(xs: list[int]) -> list[int]:
    return [x + 1 for x in xs]


def _src() -> cp.Pipeline:
    return cp.Pipeline.from_iterable(range(6))


def test_per_item_node_classes_look_up_their_kind() -> None:
    """The node class of map, filter and flat_map is registered for its kind
    and takes its rules from that kind in ``WORKER_KINDS``."""
    for cls in (Map, Filter, FlatMap):
        assert NODE_CLASSES[cls.kind] is cls
        assert cls.item_kind is WORKER_KINDS[cls.kind]


@pytest.mark.parametrize(
    ("build", "kind"),
    [
        pytest.param(lambda p, **k: p.map(_inc, **k), MAP, id="map"),
        pytest.param(lambda p, **k: p.filter(_odd, **k), FILTER, id="filter"),
        pytest.param(lambda p, **k: p.flat_map(_double, **k), FLAT_MAP, id="flat_map"),
    ],
)
def test_inline_and_parallel_nodes_share_the_length_rule(build: Any, kind: Any) -> None:
    """An inline node and a parallel node of one kind give the same total
    and the same bound, both the kind's own."""
    ctx = RunContext()
    inline = build_central(build(_src()).stages, ctx)[-1]
    parallel = build_central(build(_src(), parallel=True).stages, ctx)[-1]
    assert isinstance(parallel, Parallel) and not isinstance(inline, Parallel)
    total = Total(6)
    expected = kind.out_total(total, inline.name)
    assert inline.out_total(total) == parallel.out_total(total) == expected
    assert inline.max_items_out(None, 6) == parallel.max_items_out(None, 6)
    assert parallel.item_kind is kind


def test_spec_options_are_typed_and_list_what_the_builder_recorded() -> None:
    """A map's options are ``MapOptions`` read as attributes; as a mapping
    they list ``with_rng`` and the options that are set, as before."""
    pipe = _src().map(_inc, parallel=True).filter(_odd).dispatch().map(_inc, with_rng=True)
    parallel_map, central_filter, worker_map = pipe.stages[1], pipe.stages[2], pipe.stages[-1]
    assert isinstance(parallel_map.options, MapOptions)
    assert parallel_map.item_options.parallel and not parallel_map.item_options.with_rng
    assert dict(parallel_map.options) == {"with_rng": False, "parallel": True}
    assert isinstance(central_filter.options, StageOptions)
    assert dict(central_filter.options) == {}
    assert dict(worker_map.options) == {"with_rng": True}
    assert worker_map.options.get("batched") is None
    with pytest.raises(KeyError):
        worker_map.options["batched"]


def test_a_batched_map_applies_as_its_own_kind() -> None:
    """``map(fn, batched=True)`` is a ``map`` spec whose kind applies once
    per chunk; the worker chain gives the per-item map's outputs."""
    spec = _src().dispatch().map(_incs, batched=True).stages[-1]
    assert spec.kind == "map" and spec.item_kind is BATCHED_MAP
    result = WorkerChain([spec], seed=0).run_chunk(0, 0, [1, 2, 3])
    assert result.outputs == [2, 3, 4]


def test_the_worker_chain_applies_each_kind() -> None:
    """map, filter and flat_map after dispatch() apply as their kinds say."""
    pipe = _src().dispatch().map(_inc).filter(_odd).flat_map(_double)
    result = WorkerChain(pipe.worker_stages, seed=0).run_chunk(0, 0, [0, 1, 2, 4])
    assert result.outputs == [1, 1, 3, 3, 5, 5]
    assert result.counts == [2, 0, 2, 2]


def test_typed_options_cross_to_a_worker_unchanged() -> None:
    """A spec pickled as a worker receives it keeps its kind and options."""
    spec = _src().map(_inc, parallel=True).stages[-1]
    back = pickle.loads(pickle.dumps(spec))
    assert back.item_options == spec.item_options
    assert back.item_kind is MAP
    assert dict(back.options) == dict(spec.options)


@pytest.mark.parametrize(
    ("kind", "options", "match"),
    [
        pytest.param("filter", {"with_rng": True}, r"unknown option\(s\) \['with_rng'\]", id="rng"),
        pytest.param("collate", {"parallel": True}, r"\(its options: none\)", id="collate"),
        pytest.param("map", {"batch": True}, r"unknown option\(s\) \['batch'\]", id="typo"),
        pytest.param("map", {"parallel": 1}, r"`parallel` must be a bool, got 1", id="int"),
    ],
)
def test_a_hand_made_spec_with_a_bad_option_is_refused(
    kind: str, options: dict[str, Any], match: str
) -> None:
    """A spec built by hand with an option its kind does not take, or a
    non-bool flag, is a ``PipelineError`` naming the stage."""
    with pytest.raises(cp.PipelineError, match=rf"^stage 's': .*{match}"):
        StageSpec(kind, "s", "worker", fn=_inc, options=options)


def test_the_builder_still_refuses_a_non_bool_batched_flag() -> None:
    """``map(batched="yes")`` is refused at build, naming the stage."""
    with pytest.raises(cp.PipelineError, match=r"stage 'm': `batched` must be a bool"):
        _src().dispatch().map(_inc, batched="yes", name="m")  # type: ignore[arg-type]


def test_a_second_node_class_for_a_kind_is_refused() -> None:
    """Defining another node class for a registered kind is a ``TypeError``
    naming both classes, and leaves the registry as it was."""
    before = dict(NODE_CLASSES)
    with pytest.raises(TypeError, match=r"stage kind 'map' has two node classes: Map and"):

        class Other(CentralNode[Any]):
            kind = "map"

            def produce(self) -> Any:
                raise StopIteration

    assert before == NODE_CLASSES
