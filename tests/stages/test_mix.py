"""``Pipeline.mix``: draws, stop modes, queries, exact resume, changed weights
at a restart, and bad input."""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from itertools import islice
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.testing import assert_resumes_exactly, collect
from tests.support.configs import loader_config

LOCKSTEP = loader_config(buffer_size=1, chunk_size=1)


def _source(tag: str, n: int, shuffle: int | None = None) -> cp.Pipeline:
    pipe = cp.Pipeline.from_iterable([(tag, i) for i in range(n)])
    return pipe if shuffle is None else pipe.shuffle(shuffle, name="shuf")


def _three(shuffle: int | None = None, sizes: Sequence[int] = (30, 20, 10)) -> dict[str, Any]:
    return {tag: _source(tag, n, shuffle) for tag, n in zip("abc", sizes)}


WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}


def _per_source(items: Sequence[tuple[str, int]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for tag, i in items:
        out.setdefault(tag, []).append(i)
    return out


def _run(pipe: cp.Pipeline, config: cp.LoaderConfig | None = None) -> list[Any]:
    with cp.Loader(pipe, config) as loader:
        return collect(loader)


# -- behaviour ---------------------------------------------------------------------------


def test_all_exhausted_yields_every_item_in_each_sources_order() -> None:
    """all_exhausted interleaves every item of every source, each in its own order."""
    out = _run(cp.Pipeline.mix(_three(), WEIGHTS))
    assert _per_source(out) == {"a": list(range(30)), "b": list(range(20)), "c": list(range(10))}
    assert [t for t, _ in out[:12]] != sorted(t for t, _ in out[:12])  # really interleaved


def test_first_exhausted_ends_when_a_drawn_source_ends() -> None:
    """first_exhausted stops at the first draw of an ended source; the rest are prefixes."""
    pipe = cp.Pipeline.mix(_three(), WEIGHTS, stop="first_exhausted", name="m")
    with cp.Loader(pipe) as loader:
        out = collect(loader)
        q = loader.query("m")
    per = _per_source(out)
    sizes = {"a": 30, "b": 20, "c": 10}
    ended = [tag for tag, items in per.items() if len(items) == sizes[tag]]
    assert len(ended) >= 1
    assert all(items == list(range(len(items))) for items in per.values())
    assert len(out) < 60 and q["done"] is True
    assert q["drawn"] == {tag: len(per.get(tag, [])) for tag in "abc"}


def test_never_restarts_sources_with_a_new_shuffle_each_pass() -> None:
    """never cycles each source pass after pass; a shuffled source's passes differ."""
    pipe = cp.Pipeline.mix(_three(shuffle=8, sizes=(12, 6, 4)), WEIGHTS, stop="never", name="m")
    with cp.Loader(pipe) as loader:
        out = list(islice(loader, 400))
        q = loader.query("m")
    per = _per_source(out)
    for tag, n in zip("abc", (12, 6, 4)):
        items = per[tag]
        passes = [items[i : i + n] for i in range(0, len(items) - n + 1, n)]
        assert len(passes) >= 3, tag
        assert all(sorted(p) == list(range(n)) for p in passes), tag
        assert len({tuple(p) for p in passes}) > 1, f"{tag}: every pass has the same order"
        # The live view may run ahead of the consumer; it is self-consistent.
        assert q["drawn"][tag] >= len(items), tag
        assert q["passes"][tag] == (q["drawn"][tag] - 1) // n, tag


def test_draws_depend_on_seed_and_epoch_only() -> None:
    """Same seed: same stream; another seed or the next epoch: another interleaving."""
    pipe = cp.Pipeline.mix(_three(), WEIGHTS)
    first = _run(pipe, loader_config(seed=1))
    assert _run(pipe, loader_config(seed=1)) == first
    assert _run(pipe, loader_config(seed=2)) != first
    with cp.Loader(pipe, loader_config(seed=1)) as loader:
        epoch1, epoch2 = collect(loader), collect(loader)
    assert epoch1 == first and epoch2 != epoch1
    assert sorted(epoch2) == sorted(epoch1)


def test_zero_weight_source_is_never_drawn() -> None:
    """A source with weight 0 is left out; all_exhausted ends without it."""
    out = _run(cp.Pipeline.mix(_three(), {"a": 1, "b": 0, "c": 2.5}))
    assert sorted(_per_source(out)) == ["a", "c"] and len(out) == 40


def test_single_source_and_many_sources() -> None:
    """One source passes through; twenty sources all get drawn."""
    assert _run(cp.Pipeline.mix({"x": _source("x", 5)}, {"x": 1})) == [("x", i) for i in range(5)]
    many = {f"s{i}": _source(f"s{i}", 3) for i in range(20)}
    out = _run(cp.Pipeline.mix(many, dict.fromkeys(many, 1.0)))
    assert sorted(_per_source(out)) == sorted(many) and len(out) == 60


def test_query_inner_stages_and_metrics_by_qualified_name() -> None:
    """Inner stages are named mix/source/stage for query() and metrics()."""
    subs = {"a": _source("a", 10).count("n"), "b": _source("b", 5)}
    pipe = cp.Pipeline.mix(subs, {"a": 1, "b": 1}, name="m").count("all")
    with cp.Loader(pipe) as loader:
        collect(loader)
        assert loader.query("m/a/n") == {"items": 10, "weight": 10}
        q = loader.query("m")
        assert q["drawn"] == {"a": 10, "b": 5} and q["passes"] == {"a": 0, "b": 0}
        assert q["weights"] == {"a": 1.0, "b": 1.0} and q["stop"] == "all_exhausted"
        assert sorted(q["exhausted"]) == ["a", "b"]
        metrics = loader.metrics()
        assert metrics["m/a/n"]["items_out"] == 10 and metrics["m"]["items_in"] == 15
        with pytest.raises(ValueError, match="inside"):
            loader.query("m/a/n", delivered=True)
        with pytest.raises(KeyError, match="m/a/n"):
            loader.query("n")


def test_nested_mix_resumes_exactly() -> None:
    """A mix of mixes: names qualify twice, and resume is exact."""
    inner = cp.Pipeline.mix(_three(sizes=(6, 5, 4)), WEIGHTS, name="inner")
    pipe = cp.Pipeline.mix({"i": inner, "z": _source("z", 7, shuffle=3)}, {"i": 2, "z": 1})
    assert ["mix/i/inner/a/source", "iterable"] in pipe.fingerprint()
    full = assert_resumes_exactly(pipe, LOCKSTEP)
    assert sorted(full) == sorted(
        [(t, i) for t, n in zip("abc", (6, 5, 4)) for i in range(n)] + [("z", i) for i in range(7)]
    )


def test_never_mode_source_without_items_names_it() -> None:
    """stop='never' with an empty source is a PipelineError naming the source."""
    pipe = cp.Pipeline.mix(
        {"a": _source("a", 3), "e": _source("e", 0)}, {"a": 1, "e": 1}, stop="never"
    )
    with cp.Loader(pipe) as loader, pytest.raises(cp.PipelineError, match="source 'e'"):
        list(islice(loader, 50))


# -- exact resume ------------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_mix_resumes_exactly_at_every_k(stop: str) -> None:
    """Every k, two epochs, shuffled sub-pipelines: exact."""
    pipe = cp.Pipeline.mix(_three(shuffle=5, sizes=(14, 9, 6)), WEIGHTS, stop=stop)
    assert_resumes_exactly(pipe, LOCKSTEP, epochs=2)


def test_never_mode_resumes_exactly_at_every_k() -> None:
    """An endless mix resumes exactly at every k across several passes of each source."""
    pipe = cp.Pipeline.mix(_three(shuffle=4, sizes=(7, 5, 3)), WEIGHTS, stop="never")
    assert_resumes_exactly(pipe, LOCKSTEP, max_items=60)


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted", "never"])
def test_mix_before_bucket_and_shard_resumes_across_worker_counts(stop: str) -> None:
    """mix -> bucket_by_max_tokens -> count -> shard -> workers: exact with 0 <-> 2 workers."""
    subs = {
        tag: cp.Pipeline.from_iterable([tag * (1 + i % 7) for i in range(n)]).shuffle(6)
        for tag, n in zip("abc", (60, 40, 30))
    }
    pipe = (
        cp.Pipeline.mix(subs, {"a": 0.5, "b": 0.3, "c": 0.2}, stop=stop)
        .bucket_by_max_tokens(12, buffer_size=8)
        .count("pre_shard", weight_fn=len)
        .shard(equalize="drop_last")
        .dispatch()
        .map(tuple)
    )
    inline = loader_config(buffer_size=3, rank=1, world_size=2)
    two = loader_config(num_workers=2, buffer_size=3, rank=1, world_size=2)
    limit = 25 if stop == "never" else None
    full = assert_resumes_exactly(pipe, inline, resume_config=two, ks=[0, 3, 11], max_items=limit)
    assert len(full) >= 12
    assert_resumes_exactly(pipe, two, resume_config=inline, ks=[7, len(full) - 1], max_items=limit)


# -- changed weights at a restart ---------------------------------------------------------


def _checkpoint_after(pipe: cp.Pipeline, k: int) -> tuple[list[Any], dict[str, Any]]:
    with cp.Loader(pipe, LOCKSTEP) as loader:
        head = list(islice(loader, k))
        return head, loader.state_dict()


@pytest.mark.parametrize("stop", ["all_exhausted", "never"])
def test_changed_weights_continue_every_source_and_follow_the_new_weights(stop: str) -> None:
    """New weights at a restart: each source continues exactly where it was, and
    over 12,000 draws the proportions are within 3 standard errors of the new weights."""
    sizes = (20_000, 20_000, 20_000) if stop == "all_exhausted" else (1_000, 800, 600)
    subs = _three(shuffle=50, sizes=sizes)
    old = {"a": 0.6, "b": 0.3, "c": 0.1}
    new = {"a": 0.2, "b": 0.3, "c": 0.5}
    head, state = _checkpoint_after(cp.Pipeline.mix(subs, old, stop=stop), 1_500)
    draws = 12_000
    with cp.Loader(cp.Pipeline.mix(subs, new, stop=stop, name="mix")) as loader:
        loader.load_state_dict(state)
        it = iter(loader)
        rest = list(islice(it, draws))
        if stop == "all_exhausted":
            rest.extend(it)  # to the end of every source's pass
        drawn = loader.query("mix")["drawn"]
    counts = {tag: sum(1 for t, _ in rest[:draws] if t == tag) for tag in "abc"}
    for tag, p in new.items():
        se = math.sqrt(p * (1 - p) / draws)
        assert abs(counts[tag] / draws - p) <= 3 * se, (tag, counts, new)
    # Each source's own stream (its shuffle, pass after pass) does not depend on
    # the draws: compare it with an uninterrupted mix under other weights.
    per = _per_source(head + rest)
    if stop == "all_exhausted":
        reference = _per_source(_run(cp.Pipeline.mix(subs, old, stop=stop)))
    else:
        equal = cp.Pipeline.mix(subs, dict.fromkeys("abc", 1), stop=stop)
        with cp.Loader(equal) as loader:
            reference = _per_source(list(islice(loader, 24_000)))
    for tag, n in zip("abc", sizes):
        assert len(reference[tag]) >= len(per[tag]), tag
        assert per[tag] == reference[tag][: len(per[tag])], tag
        if stop == "all_exhausted":
            assert sorted(per[tag]) == list(range(n)) and drawn[tag] == n, tag
        else:
            passes = [per[tag][i : i + n] for i in range(0, len(per[tag]) - n + 1, n)]
            assert len(passes) >= 3 and all(sorted(p) == list(range(n)) for p in passes), tag


def test_changed_weights_keep_sources_continuous_at_every_k() -> None:
    """For every k, resuming under other weights repeats and skips no item of any source."""
    subs = _three(shuffle=4, sizes=(12, 8, 6))
    old_pipe = cp.Pipeline.mix(subs, WEIGHTS)
    new_pipe = cp.Pipeline.mix(subs, {"a": 0.1, "b": 0.1, "c": 5.0})
    reference = _per_source(_run(old_pipe))
    for k in range(27):
        head, state = _checkpoint_after(old_pipe, k)
        with cp.Loader(new_pipe) as loader:
            loader.load_state_dict(state)
            rest = collect(loader)
        assert _per_source(head + rest) == reference, k


def test_other_differences_are_still_refused() -> None:
    """Another source, stage or stop mode is a CheckpointError; only weights may change."""
    subs = _three(shuffle=4)
    _, state = _checkpoint_after(cp.Pipeline.mix(subs, WEIGHTS), 5)
    others = {
        "renamed source": cp.Pipeline.mix(
            {"a": subs["a"], "b": subs["b"], "d": subs["c"]}, {"a": 1, "b": 1, "d": 1}
        ),
        "extra stage": cp.Pipeline.mix({**subs, "c": subs["c"].map(str)}, WEIGHTS),
        "fewer sources": cp.Pipeline.mix({"a": subs["a"], "b": subs["b"]}, {"a": 1, "b": 1}),
        "extra outer stage": cp.Pipeline.mix(subs, WEIGHTS).count("n"),
    }
    for what, pipe in others.items():
        with cp.Loader(pipe) as loader, pytest.raises(cp.CheckpointError):
            loader.load_state_dict(state)
            pytest.fail(what)
    pipe = cp.Pipeline.mix(subs, WEIGHTS, stop="never")
    with cp.Loader(pipe) as loader, pytest.raises(cp.CheckpointError, match="stop must be 'never'"):
        loader.load_state_dict(state)


def test_damaged_mix_state_is_a_checkpoint_error() -> None:
    """A mix state missing a source's stages is refused, naming the mix and the source."""
    pipe = cp.Pipeline.mix(_three(shuffle=4), WEIGHTS, name="m")
    _, state = _checkpoint_after(pipe, 5)
    del state["central"]["m"]["sources"]["b"]["m/b/shuf"]
    with cp.Loader(pipe) as loader, pytest.raises(cp.CheckpointError, match=r"sources\['b'\]"):
        loader.load_state_dict(state)
    with cp.Loader(pipe) as loader:  # a failed load leaves the loader usable
        assert len(collect(loader)) == 60
    _, state = _checkpoint_after(pipe, 5)
    state["central"]["m"]["sources"]["b"]["m/b/shuf"]["buffer"] = list(range(99))
    with cp.Loader(pipe) as loader, pytest.raises(cp.CheckpointError) as info:
        loader.load_state_dict(state)
    assert "sources['b']['m/b/shuf'].buffer" in str(info.value)
    _, state = _checkpoint_after(pipe, 5)
    state["central"]["m"]["drawn"]["a"] = -1
    with cp.Loader(pipe) as loader, pytest.raises(cp.CheckpointError, match="drawn"):
        loader.load_state_dict(state)


# -- bad input ----------------------------------------------------------------------------

_GOOD = {"a": cp.Pipeline.from_iterable([1]), "b": cp.Pipeline.from_iterable([2])}


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        pytest.param([0.5, 0.5], "dict", id="list"),
        pytest.param({"a": 1}, r"missing \['b'\]", id="missing"),
        pytest.param({"a": 1, "b": 1, "z": 1}, r"unknown \['z'\]", id="unknown"),
        pytest.param({"a": -1, "b": 1}, "source 'a'", id="negative"),
        pytest.param({"a": math.nan, "b": 1}, "source 'a'", id="nan"),
        pytest.param({"a": math.inf, "b": 1}, "source 'a'", id="inf"),
        pytest.param({"a": True, "b": 1}, "source 'a'", id="bool"),
        pytest.param({"a": "1", "b": 1}, "source 'a'", id="str"),
        pytest.param({"a": 0, "b": 0.0}, "at least one", id="all-zero"),
        pytest.param({"a": None, "b": 1}, "source 'a'.*got NoneType", id="none"),
        pytest.param({"a": 10**400, "b": 1}, "source 'a'.*int beyond the float", id="huge-int"),
        pytest.param({"a": 1, "b": -(10**400)}, "source 'b'.*beyond the float", id="huge-neg"),
        pytest.param(
            {"a": Fraction(10**400, 3), "b": 1}, "source 'a'.*Fraction beyond", id="huge-fraction"
        ),
        pytest.param({"a": 10**5000, "b": 1}, "source 'a'.*beyond", id="past-int-str-limit"),
        pytest.param({"a": 1e308, "b": 1e308}, "finite sum", id="sum-overflows"),
    ],
)
def test_bad_weights_name_the_problem(weights: Any, match: str) -> None:
    """Weights must be finite floats, >= 0, not all 0, with a finite sum, one per
    source: anything else is a PipelineError at build naming the mix and the source."""
    with pytest.raises(cp.PipelineError, match=f"mix 'm': .*{match}"):
        cp.Pipeline.mix(_GOOD, weights, name="m")


def test_weights_of_any_real_type_become_floats() -> None:
    """Big ints and Fractions within the float range are kept, as floats."""
    weights = {"a": 10**300, "b": Fraction(1, 3)}
    pipe = cp.Pipeline.mix(_GOOD, weights, name="m", stop="all_exhausted")
    with cp.Loader(pipe) as loader:
        assert sorted(loader) == [1, 2]
        assert loader.query("m")["weights"] == {"a": 1e300, "b": 1 / 3}


@pytest.mark.parametrize(
    ("pipelines", "kwargs", "match"),
    [
        pytest.param({}, {}, "non-empty dict", id="empty"),
        pytest.param([_GOOD["a"]], {}, "dict", id="list"),
        pytest.param({"a": [1, 2]}, {}, "source 'a' must be a Pipeline", id="not-pipeline"),
        pytest.param({"a/b": _GOOD["a"]}, {}, "without '/'", id="slash"),
        pytest.param({"": _GOOD["a"]}, {}, "without '/'", id="empty-key"),
        pytest.param(
            {"a": _GOOD["a"].dispatch()}, {}, "source 'a' has stage 'dispatch'", id="dispatch"
        ),
        pytest.param(
            {"a": _GOOD["a"].dispatch().map(str, name="w")}, {}, "source 'a'", id="worker-stage"
        ),
        pytest.param({"a": _GOOD["a"].shard()}, {}, "source 'a' has a shard", id="shard"),
        pytest.param({"a": _GOOD["a"]}, {"stop": "longest"}, "stop", id="stop"),
        pytest.param({"a": _GOOD["a"]}, {"name": ""}, "name", id="empty-name"),
    ],
)
def test_bad_mix_arguments_name_the_problem(
    pipelines: Any, kwargs: dict[str, Any], match: str
) -> None:
    """Bad sub-pipelines, keys, stop modes and names raise PipelineError at build."""
    weights = dict.fromkeys(pipelines, 1) if isinstance(pipelines, dict) else {"a": 1}
    with pytest.raises(cp.PipelineError, match=match):
        cp.Pipeline.mix(pipelines, weights, **kwargs)


def test_qualified_names_cannot_clash_with_outer_stages() -> None:
    """An outer stage may not take a name used inside the mix."""
    pipe = cp.Pipeline.mix(_GOOD, {"a": 1, "b": 1})
    with pytest.raises(cp.PipelineError, match="mix/a/source"):
        pipe.map(str, name="mix/a/source")
    assert pipe.map(str, name="source").fingerprint()[-1] == ["source", "map"]


def test_mix_after_dispatch_stages_come_after_it() -> None:
    """dispatch() and worker stages go after the mix, and run there."""
    pipe = cp.Pipeline.mix(_GOOD, {"a": 1, "b": 1}).dispatch().map(lambda x: x * 10)
    assert sorted(_run(pipe, loader_config(num_workers=2))) == [10, 20]


def test_inspect_lists_the_stages_inside_a_mix() -> None:
    """`inspect` shows the mix's state and lists its inner stages as such."""
    from centralpipe.__main__ import summarize_checked

    _, state = _checkpoint_after(cp.Pipeline.mix(_three(shuffle=4), WEIGHTS, name="m").count(), 5)
    text, problem = summarize_checked(state)
    assert problem == ""
    assert "m (mix):" in text and "drawn: " in text
    assert "stages inside mixes: m/a/source (iterable), m/a/shuf (shuffle)" in text
    assert "dispatch and worker stages" not in text


def test_glob_matching_nothing_inside_a_mix_fails_when_the_loader_starts(tmp_path: Any) -> None:
    """A sub-pipeline's from_files glob is resolved when the Loader is made, naming the stage."""
    pipe = cp.Pipeline.mix(
        {"a": _source("a", 3), "f": cp.Pipeline.from_files(str(tmp_path / "*.none")).read_lines()},
        {"a": 1, "f": 1},
    )
    with pytest.raises(cp.PipelineError, match="stage 'mix/f/files': the glob"):
        cp.Loader(pipe)
