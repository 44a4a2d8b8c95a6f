"""``pack``: reference outputs, budget, fill rate, oversize items, exact resume,
bad input; and the worker-side ``centralpipe.packing`` helpers."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import centralpipe as cp
from centralpipe.testing import assert_resumes_exactly, collect
from tests.support.configs import loader_config

CORPUS_GLOB = str(Path(__file__).resolve().parents[2] / "examples" / "data" / "*.txt")
LOCKSTEP = loader_config(buffer_size=1, chunk_size=1)


def reference_pack(
    lengths: list[int], max_tokens: int, strategy: str, buffer_size: int
) -> list[list[int]]:
    """The documented rule, written plainly (O(groups) per item): indices of
    the items in each emitted group."""
    open_groups: list[list[Any]] = []  # [room, [indices]] in age order
    out: list[list[int]] = []
    held = 0
    for i, n in enumerate(lengths):
        fits = [g for g in open_groups if g[0] >= n]
        if not fits:
            target: list[Any] = [max_tokens, []]
            open_groups.append(target)
        elif strategy == "first_fit":
            target = fits[0]
        else:
            target = min(fits, key=lambda g: g[0])  # min() keeps the first (oldest) on ties
        target[0] -= n
        target[1].append(i)
        held += 1
        if target[0] == 0:
            open_groups.remove(target)
            out.append(target[1])
            held -= len(target[1])
        elif held > buffer_size:
            oldest = open_groups.pop(0)
            out.append(oldest[1])
            held -= len(oldest[1])
    out.extend(g[1] for g in open_groups)
    return out


def _lengths(seed: int, n: int, low: int, high: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


def _tokens(lengths: list[int]) -> list[list[int]]:
    """Item ``i`` is ``[i] * length``, so a group shows which items it holds."""
    return [[i] * n for i, n in enumerate(lengths)]


def _indices(groups: list[list[list[int]]], lengths: list[int]) -> list[list[int]]:
    out = []
    for group in groups:
        idx = []
        for seq in group:
            assert len(set(seq)) <= 1
            idx.append(seq[0] if seq else next(i for i, n in enumerate(lengths) if n == 0))
        out.append(idx)
    return out


def _run(pipe: cp.Pipeline, config: cp.LoaderConfig | None = None) -> list[Any]:
    with cp.Loader(pipe, config) as loader:
        return collect(loader)


CASES = [
    pytest.param(1, 300, 1, 50, 100, 20, id="small-buffer"),
    pytest.param(2, 300, 1, 50, 100, 1, id="buffer-1"),
    pytest.param(3, 400, 1, 100, 100, 1000, id="buffer-larger-than-input"),
    pytest.param(4, 500, 90, 100, 100, 8, id="near-full-items"),
    pytest.param(5, 600, 1, 8, 64, 300, id="many-small"),
    pytest.param(6, 2000, 60, 100, 100, 5, id="first-fit-slot-rebuilds"),
]


@pytest.mark.parametrize("strategy", ["first_fit", "best_fit"])
@pytest.mark.parametrize(("seed", "n", "low", "high", "max_tokens", "buffer"), CASES)
def test_pack_matches_the_reference(
    strategy: str, seed: int, n: int, low: int, high: int, max_tokens: int, buffer: int
) -> None:
    """Groups equal the plainly written rule, stay within max_tokens and keep every item."""
    lengths = _lengths(seed, n, low, high)
    pipe = cp.Pipeline.from_iterable(_tokens(lengths)).pack(
        max_tokens, strategy=strategy, buffer_size=buffer
    )
    groups = _run(pipe)
    assert _indices(groups, lengths) == reference_pack(lengths, max_tokens, strategy, buffer)
    assert all(0 < sum(map(len, g)) <= max_tokens for g in groups)
    assert sorted(i for g in _indices(groups, lengths) for i in g) == list(range(n))


def test_pack_hand_computed() -> None:
    """Lengths 6,5,4,3,2 into 10: first-fit and best-fit place the 3 differently."""
    items = [[6] * 6, [5] * 5, [4] * 4, [3] * 3, [1]]
    first = _run(cp.Pipeline.from_iterable(items).pack(10, strategy="first_fit", buffer_size=9))
    best = _run(cp.Pipeline.from_iterable(items).pack(10, strategy="best_fit", buffer_size=9))
    # first-fit: 6 | 5 -> new; 4 -> with 6 (full, leaves); 3 -> with 5; 1 -> with 5,3
    assert [[s[0] for s in g] for g in first] == [[6, 4], [5, 3, 1]]
    # best-fit: 4 -> group of 6 (room 4, fills it); 3 -> group of 5; 1 -> same
    assert [[s[0] for s in g] for g in best] == [[6, 4], [5, 3, 1]]
    items = [[7] * 7, [5] * 5, [3] * 3]
    best = _run(cp.Pipeline.from_iterable(items).pack(10, strategy="best_fit", buffer_size=9))
    first = _run(cp.Pipeline.from_iterable(items).pack(10, strategy="first_fit", buffer_size=9))
    assert [[s[0] for s in g] for g in best] == [[7, 3], [5]]  # 3 fills the 7 exactly
    assert [[s[0] for s in g] for g in first] == [[7, 3], [5]]
    items = [[5] * 5, [7] * 7, [3] * 3]
    best = _run(cp.Pipeline.from_iterable(items).pack(10, strategy="best_fit", buffer_size=9))
    first = _run(cp.Pipeline.from_iterable(items).pack(10, strategy="first_fit", buffer_size=9))
    assert [[s[0] for s in g] for g in first] == [[5, 3], [7]]  # the oldest group it fits
    assert [[s[0] for s in g] for g in best] == [[7, 3], [5]]  # the fullest group it fits


def test_pack_zero_length_items_and_exact_fits() -> None:
    """Empty items join an open group; an item of exactly max_tokens leaves alone at once."""
    items = [[], [1] * 4, [2] * 10, []]
    groups = _run(cp.Pipeline.from_iterable(items).pack(10, buffer_size=5))
    assert groups == [[[2] * 10], [[], [1] * 4, []]]


@pytest.mark.parametrize("strategy", ["first_fit", "best_fit"])
def test_pack_oversize_raise_names_stage_and_length(strategy: str) -> None:
    """An item longer than max_tokens is a PipelineError at iteration naming stage and length."""
    pipe = cp.Pipeline.from_iterable([[1] * 3, [1] * 12]).pack(10, strategy=strategy, name="packer")
    with cp.Loader(pipe) as loader, pytest.raises(cp.PipelineError) as info:
        collect(loader)
    assert "stage 'packer'" in str(info.value)
    assert "length 12" in str(info.value)
    assert "max_tokens=10" in str(info.value)


def test_pack_oversize_drop_is_counted() -> None:
    """oversize='drop' drops longer items and counts them in query()."""
    items = [[1] * 3, [2] * 12, [3] * 4, [4] * 11]
    pipe = cp.Pipeline.from_iterable(items).pack(10, oversize="drop", name="packer")
    with cp.Loader(pipe) as loader:
        assert collect(loader) == [[[1] * 3, [3] * 4]]
        q = loader.query("packer")
    assert q["dropped"] == 2
    assert q["groups"] == 1 and q["tokens"] == 7 and q["capacity"] == 10
    assert q["fill_rate"] == pytest.approx(0.7)


def test_pack_query_reports_fill_rate_so_far() -> None:
    """query() gives groups, tokens, capacity and fill rate as the epoch goes."""
    items = [[1] * 6, [1] * 4, [1] * 7, [1] * 2]
    pipe = cp.Pipeline.from_iterable(items).pack(10, name="packer", buffer_size=10)
    with cp.Loader(pipe, LOCKSTEP) as loader:
        assert loader.query("packer")["fill_rate"] is None  # nothing emitted yet
        it = iter(loader)
        assert next(it) == [[1] * 6, [1] * 4]
        q = loader.query("packer")
        assert (q["groups"], q["tokens"], q["fill_rate"]) == (1, 10, 1.0)
        assert list(it) == [[[1] * 7, [1] * 2]]
        q = loader.query("packer")
        assert (q["groups"], q["tokens"], q["capacity"]) == (2, 19, 20)
        assert q["fill_rate"] == pytest.approx(0.95)
        assert q["buffered"] == 0 and q["open_groups"] == 0


def _rand_tokens(n: int, seed: int = 7, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[i] * rng.randint(1, high) for i in range(n)]


@pytest.mark.parametrize("strategy", ["first_fit", "best_fit"])
def test_pack_resumes_exactly_at_every_k(strategy: str) -> None:
    """Checkpoints at every k (the open groups are state) resume exactly, two epochs."""
    pipe = cp.Pipeline.from_iterable(_rand_tokens(150)).pack(64, strategy=strategy, buffer_size=12)
    assert_resumes_exactly(pipe, LOCKSTEP, epochs=2)


def test_pack_resumes_across_worker_counts() -> None:
    """pack before shard and workers resumes exactly with 0 <-> 2 workers."""
    pipe = (
        cp.Pipeline.from_iterable(_rand_tokens(240))
        .pack(64, strategy="first_fit", buffer_size=16, oversize="drop")
        .count("rows")
        .shard(equalize="drop_last")
        .dispatch()
        .map(cp.packing.segments)
    )
    inline = loader_config(buffer_size=3, rank=1, world_size=2)
    two = loader_config(num_workers=2, buffer_size=3, rank=1, world_size=2)
    full = assert_resumes_exactly(pipe, inline, resume_config=two, ks=[0, 17, 39])
    assert len(full) == 40
    assert_resumes_exactly(pipe, two, resume_config=inline, ks=[1, 30])


def test_pack_on_the_bundled_corpus_best_fit_fills_at_least_first_fit() -> None:
    """On examples/data both strategies are deterministic; best_fit fills >= first_fit."""
    rates = {}
    for strategy in ("first_fit", "best_fit"):
        pipe = (
            cp.Pipeline.from_files(CORPUS_GLOB)
            .read_lines()
            .map(str.split)
            .filter(bool)
            .pack(256, strategy=strategy, buffer_size=1000, name="packer")
        )
        with cp.Loader(pipe) as loader:
            first = collect(loader)
            q = loader.query("packer")
            again = collect(loader)  # the next epoch packs identically
        assert first == again
        assert all(sum(map(len, g)) <= 256 for g in first)
        assert q["groups"] == len(first)
        assert q["tokens"] == sum(len(s) for g in first for s in g)
        rates[strategy] = q["fill_rate"]
    assert rates["best_fit"] >= rates["first_fit"] > 0.9, rates


# -- bad input ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"max_tokens": 0}, "max_tokens", id="max-tokens-0"),
        pytest.param({"max_tokens": 2.5}, "max_tokens", id="max-tokens-float"),
        pytest.param({"buffer_size": 0}, "buffer_size", id="buffer-0"),
        pytest.param({"buffer_size": None}, "buffer_size", id="buffer-none"),
        pytest.param({"strategy": "next_fit"}, "strategy", id="strategy"),
        pytest.param({"oversize": "truncate"}, "oversize", id="oversize"),
        pytest.param({"len_fn": 3}, "len_fn", id="len-fn"),
    ],
)
def test_pack_bad_arguments_name_the_field(kwargs: dict[str, Any], match: str) -> None:
    """Bad pack() arguments raise PipelineError at build naming the stage and field."""
    args = {"max_tokens": 10, **kwargs}
    max_tokens = args.pop("max_tokens")
    with pytest.raises(cp.PipelineError, match=match) as info:
        cp.Pipeline.from_iterable([[1]]).pack(max_tokens, name="packer", **args)
    assert "'packer'" in str(info.value)


def test_pack_after_dispatch_is_refused() -> None:
    """pack is a central stage: after dispatch() it is a PipelineError."""
    with pytest.raises(cp.PipelineError, match="central"):
        cp.Pipeline.from_iterable([[1]]).dispatch().pack(10)


@pytest.mark.parametrize(
    "len_fn",
    [lambda x: -1, lambda x: "3", lambda x: True, lambda x: 2.0],
    ids=["negative", "str", "bool", "float"],
)
def test_pack_bad_len_fn_result_names_the_stage(len_fn: Callable[[Any], Any]) -> None:
    """A len_fn returning anything but an int >= 0 fails at iteration naming the stage."""
    pipe = cp.Pipeline.from_iterable([[1]]).pack(10, len_fn=len_fn, name="packer")
    with cp.Loader(pipe) as loader, pytest.raises(cp.PipelineError, match=r"'packer'.*len_fn"):
        collect(loader)


def test_pack_damaged_state_is_a_checkpoint_error() -> None:
    """An open group with impossible room in the checkpoint is refused, naming the stage."""
    pipe = cp.Pipeline.from_iterable(_rand_tokens(50)).pack(64, buffer_size=8, name="packer")
    with cp.Loader(pipe, LOCKSTEP) as loader:
        it = iter(loader)
        next(it)
        sd = loader.state_dict()
    assert sd["central"]["packer"]["groups"], "the checkpoint should hold open groups"
    sd["central"]["packer"]["groups"][0][0] = 500
    with cp.Loader(pipe) as loader, pytest.raises(cp.CheckpointError, match="'packer'"):
        loader.load_state_dict(sd)
    sd["central"]["packer"]["groups"] = "nonsense"
    with cp.Loader(pipe) as loader, pytest.raises(cp.CheckpointError, match="packer"):
        loader.load_state_dict(sd)


# -- centralpipe.packing ------------------------------------------------------------


def test_segments_tokens_ids_positions_and_cu_seqlens() -> None:
    """segments() concatenates, numbers segments, restarts positions and pads."""
    out = cp.packing.segments([[5, 6, 7], torch.tensor([8, 9]), []], pad_to=7, pad_id=-9)
    assert out["tokens"].tolist() == [5, 6, 7, 8, 9, -9, -9]
    assert out["segment_ids"].tolist() == [0, 0, 0, 1, 1, -1, -1]
    assert out["positions"].tolist() == [0, 1, 2, 0, 1, 0, 0]
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 5]
    assert out["cu_seqlens"].dtype == torch.int32
    assert all(out[k].dtype == torch.long for k in ("tokens", "segment_ids", "positions"))
    unpadded = cp.packing.segments([[1], [2, 3]])
    assert unpadded["tokens"].tolist() == [1, 2, 3]
    assert unpadded["positions"].tolist() == [0, 0, 1]


@pytest.mark.parametrize(
    ("group", "kwargs", "error", "match"),
    [
        pytest.param([], {}, ValueError, "empty", id="empty"),
        pytest.param("abc", {}, TypeError, "group", id="str"),
        pytest.param([[1, 2, 3]], {"pad_to": 2}, ValueError, "pad_to=2", id="too-long"),
        pytest.param([[1], "ab"], {}, TypeError, "sequence 1", id="str-sequence"),
        pytest.param([[1, "x"]], {}, TypeError, "sequence 0", id="non-int"),
        pytest.param([torch.ones(2, 2, dtype=torch.long)], {}, ValueError, "1-D", id="2d"),
        pytest.param([torch.ones(2)], {}, ValueError, "integer", id="float-tensor"),
        pytest.param([[1]], {"pad_to": 2.0}, TypeError, "pad_to", id="float-pad-to"),
    ],
)
def test_segments_bad_input(group: Any, kwargs: dict[str, Any], error: type, match: str) -> None:
    """segments() refuses what is not a group of int sequences, naming the problem."""
    with pytest.raises(error, match=match):
        cp.packing.segments(group, **kwargs)


def test_attention_mask_is_block_diagonal_and_causal() -> None:
    """Positions attend within their own segment, causally; padding only to itself."""
    seg = cp.packing.segments([[1, 2], [3, 4, 5]], pad_to=6)["segment_ids"]
    mask = cp.packing.attention_mask(seg)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    full = cp.packing.attention_mask(seg, causal=False)
    assert full[2].tolist() == [False, False, True, True, True, False]
    batched = cp.packing.attention_mask(torch.stack([seg, seg]))
    assert batched.shape == (2, 6, 6) and torch.equal(batched[1], expected)
    q = torch.randn(1, 6, 4)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert not out.isnan().any()
    with pytest.raises(TypeError, match="segment_ids"):
        cp.packing.attention_mask([0, 0, 1])  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), max_size=120),
    max_tokens=st.integers(1, 40),
    buffer=st.integers(1, 30),
    strategy=st.sampled_from(["first_fit", "best_fit"]),
)
def test_pack_property_matches_the_reference(
    lengths: list[int], max_tokens: int, buffer: int, strategy: str
) -> None:
    """For any lengths, budget and buffer, pack() equals the plainly written rule."""
    lengths = [min(n, max_tokens) for n in lengths]
    pipe = cp.Pipeline.from_iterable(list(range(len(lengths)))).pack(
        max_tokens, len_fn=lengths.__getitem__, strategy=strategy, buffer_size=buffer
    )
    assert _run(pipe) == reference_pack(lengths, max_tokens, strategy, buffer)
