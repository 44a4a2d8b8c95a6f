"""The one typed checkpoint: ``checkpoint.model`` alone spells the layout, and
every in-flight entry shape goes wire -> model -> wire unchanged."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import centralpipe as cp
from centralpipe import checkpoint
from centralpipe.checkpoint import compact, model
from centralpipe.checkpoint.inspect import summarize_checked
from centralpipe.checkpoint.model import Boundary, Captured, entry_wire
from centralpipe.errors import CheckpointError
from tests.support.configs import loader_config

PACKAGE = Path(cp.__file__).parent
MODEL = PACKAGE / "checkpoint" / "model.py"
#: The layout's own keys: no module but the model writes or reads them.
LAYOUT_KEYS = frozenset(
    {"first_seq", "skip_outputs", "delivered_stamp", "in_flight", "pre_shard_index"}
)
#: (module, key) pairs that are another layout's key of the same spelling.
OTHER_LAYOUTS = {
    ("metrics.py", "in_flight"): "metrics()[stage]['parallel']['in_flight']: a count",
}


def _docstrings(tree: ast.AST) -> set[int]:
    """``id``s of the docstring constants of ``tree`` (module, classes, functions)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _slots(tree: ast.AST) -> set[int]:
    """``id``s of the strings in ``__slots__`` (attribute names, not keys)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            out.update(id(c) for c in ast.walk(node.value) if isinstance(c, ast.Constant))
    return out


def _key_literals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    skip = _docstrings(tree) | _slots(tree)
    return [
        f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in LAYOUT_KEYS
        and id(node) not in skip
        and (str(path.relative_to(PACKAGE)), node.value) not in OTHER_LAYOUTS
    ]


def test_only_the_model_spells_the_layout_keys() -> None:
    """No module but ``checkpoint/model.py`` has the layout's keys as string
    literals (docstrings, comments and ``__slots__`` aside): one writer and
    reader of the layout."""
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != MODEL
        for hit in _key_literals(path)
    ]
    assert found == []


def test_the_key_scan_sees_the_models_keys() -> None:
    """The scan finds every layout key in the model itself (it is not vacuous)."""
    seen = {hit.rsplit(": ", 1)[1].strip("'") for hit in _key_literals(MODEL)}
    assert seen == LAYOUT_KEYS


def _arrays() -> list[Any]:
    return [np.arange(n, dtype=np.int32) for n in (3, 1, 4)]


ENTRIES: dict[str, dict[str, Any]] = {
    "empty": dict(next_seq=0, first_seq=0, items=[], stamps=None, skip_outputs=0, skip=[]),
    "plain": dict(next_seq=7, first_seq=4, items=[4, 5, 6], stamps=None, skip_outputs=0, skip=[]),
    "count-stamps": dict(
        next_seq=3,
        first_seq=1,
        items=["b", "c"],
        stamps=[[[1, 1.5]], [[2, 3.0]]],
        skip_outputs=0,
        skip=[],
    ),
    "shard-stamps": dict(
        next_seq=2,
        first_seq=0,
        items=[10, 11],
        stamps=[[[0, [1, 1]]], [[1, [2, 2]]]],
        skip_outputs=0,
        skip=[],
        delivered_stamp=[[0, [0, 0]]],
    ),
    "skipped": dict(
        next_seq=9, first_seq=5, items=[5, 6, 7, 8], stamps=None, skip_outputs=2, skip=[6, 8]
    ),
    "ranges": dict(
        next_seq=12,
        first_seq=2,
        items=["x", "y"],
        stamps=None,
        skip_outputs=0,
        skip=[3],
        ranges=[[0, "a.txt", 0, 40, 6, 1], [2, "b.txt", 8, 30, 3, 0]],
    ),
}


@pytest.mark.parametrize("shape", sorted(ENTRIES), ids=sorted(ENTRIES))
def test_an_entry_round_trips_through_the_model(shape: str) -> None:
    """wire -> ``Boundary.from_wire`` -> ``to_wire`` gives the same entry, and
    the model's fields are the wire's values."""
    wire = entry_wire(**ENTRIES[shape])
    entry = Boundary.from_wire(wire)
    assert entry.to_wire() == wire
    assert Boundary.from_wire(entry.to_wire()) == entry
    assert entry.first_seq == wire["first_seq"] and entry.skip_outputs == wire["skip_outputs"]
    assert entry.ranges == ENTRIES[shape].get("ranges", [])
    assert ("ranges" in wire) == bool(entry.ranges)  # absent when no line is in flight as a range


def test_a_compact_entry_decodes_to_its_arrays() -> None:
    """Compact items (one flat tensor plus lengths) are the same arrays in the
    model, and its wire form holds them decoded."""
    items = _arrays()
    wire = entry_wire(
        next_seq=3,
        first_seq=0,
        items=compact.encode_items(items),
        stamps=None,
        skip_outputs=0,
        skip=[],
    )
    assert compact.is_compact(wire["items"])
    entry = Boundary.from_wire(wire)
    assert len(entry.items) == 3
    for got, want in zip(entry.items, items):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    back = Boundary.from_wire(entry.to_wire())
    assert all(np.array_equal(a, b) for a, b in zip(back.items, items))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        pytest.param(
            {"next_seq": 5}, r"in_flight\['par'\]\.next_seq must be first_seq", id="next_seq"
        ),
        pytest.param({"skip": [0]}, r"in_flight\['par'\]\.skip must be distinct seqs", id="skip"),
        pytest.param(
            {"stamps": [[[1, 1]]]}, r"in_flight\['par'\]\.stamps must be None or one", id="stamps"
        ),
        pytest.param(
            {"skip_outputs": -1}, r"in_flight\['par'\]\.skip_outputs must be an int", id="neg"
        ),
    ],
)
def test_a_damaged_entry_is_refused_with_its_key_path(change: dict[str, Any], match: str) -> None:
    """``Boundary.from_wire`` names the boundary and field of the damage."""
    wire = {**entry_wire(**ENTRIES["plain"]), **change}
    with pytest.raises(CheckpointError, match=match):
        Boundary.from_wire(wire, "par")


def test_an_unknown_entry_key_is_refused() -> None:
    """An entry with a key the layout does not have is damaged, not ignored."""
    with pytest.raises(CheckpointError, match=r"unexpected key\(s\) \['extra'\]"):
        Boundary.from_wire({**entry_wire(**ENTRIES["plain"]), "extra": 1})


def test_a_node_ranks_items_extend_its_entry() -> None:
    """``Captured.extend`` appends items after the entry's with the next seqs;
    with none in flight they start at ``next_seq``."""
    body = Captured(entry_wire(**ENTRIES["plain"]), False, 4, 0)
    body.extend([7, 8], None)
    assert Boundary.from_wire(body.entry).items == [4, 5, 6, 7, 8]
    assert (body.entry["first_seq"], body.entry["next_seq"]) == (4, 9)
    empty = Captured(entry_wire(**{**ENTRIES["empty"], "next_seq": 6, "first_seq": 6}), False, 6, 0)
    empty.extend([6], None)
    assert (empty.entry["first_seq"], empty.entry["next_seq"]) == (6, 7)


def _tokens(i: int) -> np.ndarray:
    return np.arange(i % 5 + 1, dtype=np.int64)


PIPES = {
    "plain": lambda: cp.Pipeline.from_iterable(range(40)).dispatch().map(str),
    "stamps": lambda: cp.Pipeline.from_iterable(range(40)).count(name="c").dispatch().map(str),
    "compact": lambda: cp.Pipeline.from_iterable(range(40)).map(_tokens).dispatch().map(len),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(PIPES), ids=sorted(PIPES))
def test_state_dict_is_the_models_wire_form(kind: str) -> None:
    """Mid-epoch with items in flight, ``state_dict()`` (the fast writer)
    structures into the model and resumes exactly."""
    with cp.Loader[Any](PIPES[kind](), loader_config(num_workers=2, chunk_size=4)) as loader:
        full = list(loader)
        it = iter(loader)
        head = [next(it) for _ in range(9)]
        sd = loader.state_dict()
    ckpt = checkpoint.structure(sd)
    tip = ckpt.in_flight["dispatch"]
    assert tip.first_seq + len(tip.items) == tip.next_seq and tip.items
    assert (tip.stamps is not None) == (kind == "stamps")
    assert ckpt.position.delivered == 9
    with cp.Loader[Any](PIPES[kind](), loader_config(num_workers=1)) as again:
        again.load_state_dict(sd)
        assert again.state_dict().keys() == sd.keys()  # pending: the loaded dict
        assert head + list(again) == full


@pytest.mark.timeout(60)
def test_inspect_counts_compact_in_flight_items() -> None:
    """``inspect`` reads the model: in-flight token arrays saved compact are
    counted as the items they are, not as the keys of their encoding."""
    with cp.Loader[Any](PIPES["compact"](), loader_config(num_workers=2, chunk_size=4)) as loader:
        it = iter(loader)
        for _ in range(5):
            next(it)
        sd = loader.state_dict()
    items = model.in_flight_items(sd)
    assert items and compact.is_compact(sd["in_flight"]["dispatch"]["items"])
    text, problem = summarize_checked(sd)
    assert problem == ""
    assert f"in-flight items at 'dispatch': {items} (" in text


def test_inspect_summarises_a_damaged_state_from_what_it_can_read() -> None:
    """A state that does not pass the model is still outlined, the damage named."""
    sd = entry_wire(**ENTRIES["plain"])
    state = {"format_version": 2, "epoch": 1, "in_flight": {"dispatch": {**sd, "next_seq": -1}}}
    text, problem = summarize_checked(state)
    assert "in-flight items at 'dispatch': 3 (seqs from 4, next_seq -1" in text
    assert "rank / world size: ? / ?" in text
    assert problem.startswith("damaged checkpoint: ")


def test_a_loaded_checkpoint_resumes_from_its_model(tmp_path: Path) -> None:
    """A checkpoint saved to disk and loaded back resumes from the typed model
    (torch.save keeps tuples as lists: stamps become tuples again)."""
    pipe = cp.Pipeline.from_iterable(range(20)).count(name="c").shard().dispatch().map(str)
    with cp.Loader[Any](pipe, loader_config(num_workers=2, chunk_size=2)) as loader:
        full = list(loader)
        it = iter(loader)
        head = [next(it) for _ in range(7)]
        torch.save(loader.state_dict(), tmp_path / "s.pt")
    sd = torch.load(tmp_path / "s.pt", weights_only=True)
    with cp.Loader[Any](pipe, loader_config(num_workers=0)) as again:
        again.load_state_dict(sd)
        assert again.query("c", delivered=True)["items"] == 7
        assert head + list(again) == full
