"""Known totals: how many items each stage yields per epoch, without iterating.

:func:`chain_totals` walks a plan and gives each stage a :class:`Total` (an
item count, *exact* or only an *upper bound*) or ``None`` (unknown). The rules:

Each central kind's rule is its node class's ``out_total`` (the kind's one
home), each worker kind's is in ``pipeline.WORKER_KINDS``; sources and
``read_lines``/``mix``, which need the chain around them, are walked here:

- sources with a length (sequences, datasets, file lists): exact;
- ``read_lines`` after ``from_files`` (with only ``shuffle``/``count`` between):
  the files' line counts, exact (counted over the raw bytes, cached per file by
  size and mtime); a ``filter`` or ``shard`` of the paths makes it an upper
  bound (the lines of every file);
- ``read_parquet`` the same way: rows (or batches of ``batch_rows`` per row
  group) from the footers, exact; ``read_jsonl``: the non-blank lines of
  uncompressed local files, exact with ``errors="strict"`` and an upper bound
  with ``errors="skip"``; unknown when a file is compressed or a URL (it would
  have to be read whole);
- ``map``, ``count``, ``shuffle``, ``collate``: unchanged; ``batch``: ceil (or
  floor with ``drop_last``); ``shard``: this rank's share;
- ``filter``, ``bucket_by_max_tokens``, ``pack``: at most their input (each
  emitted list holds at least one item), so an upper bound;
- ``mix``: ``all_exhausted`` the sum over sources with weight > 0 (exact when
  theirs are); ``first_exhausted`` that sum as an upper bound; ``never``
  endless, so unknown;
- ``flat_map`` and sources without a length: unknown.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from centralpipe.plan.pipeline import WORKER_KINDS, StageSpec
from centralpipe.stages.base import RunContext, Total
from centralpipe.stages.files import count_lines
from centralpipe.stages.mix import Mix
from centralpipe.stages.sources import FilesSource

__all__ = ["Total", "chain_totals", "exact_length", "first_unknown"]

#: Stages between from_files and read_lines that keep the set of paths.
SAME_PATHS = ("count", "shuffle")
SUBSET_PATHS = ("filter", "shard")
#: Readers whose total is their files' items (``read_lines``' lines, or the
#: reader's ``items_in(path)``).
FILE_READERS = ("read_lines", "read_jsonl", "read_parquet")


def _reader_total(
    specs: Sequence[StageSpec], nodes: Sequence[Any], i: int, count_files: bool
) -> Total | None:
    """Items of the files feeding the file reader at index ``i``: ``read_lines``'
    lines, or what the reader's ``items_in`` counts (``None``: unknown)."""
    bound_by = None
    j = i - 1
    while j > 0 and specs[j].kind in SAME_PATHS + SUBSET_PATHS:
        if specs[j].kind in SUBSET_PATHS:
            bound_by = specs[j].name
        j -= 1
    if not count_files or not isinstance(nodes[j], FilesSource):
        return None
    reader = nodes[i]
    count = count_lines if specs[i].kind == "read_lines" else reader.items_in
    items = 0
    try:
        for path in nodes[j].paths:
            n = count(path)
            if n is None:
                return None
            items += n
    except (OSError, ValueError):
        return None  # unreadable now (or not Parquet): reading will raise, naming the stage
    if bound_by is None and not getattr(reader, "items_exact", True):
        bound_by = specs[i].name
    return Total(items, bound_by is None, bound_by)


def _mix_total(spec: StageSpec, node: Mix, count_files: bool) -> Total | None:
    stop = spec.options["stop"]
    if stop == "never":
        return None
    exact = stop == "all_exhausted"
    items, bound_by = 0, None if exact else spec.name
    for key, weight, nodes in node.sources():
        if weight <= 0:
            continue
        sub = chain_totals(nodes, spec.options["pipelines"][key].stages, node.ctx, count_files)
        total = sub[nodes[-1].name]
        if total is None:
            return None
        items += total.items
        if exact and not total.exact:
            exact, bound_by = False, total.bound_by
    return Total(items, exact, bound_by)


def chain_totals(
    nodes: Sequence[Any], specs: Sequence[StageSpec], ctx: RunContext, count_files: bool = True
) -> dict[str, Total | None]:
    """Each stage's items per epoch (stages inside a ``mix`` included, by their
    qualified names); worker stages may follow the central ones in ``specs``
    with no node (``nodes`` shorter than ``specs``). ``count_files=False``
    leaves ``read_lines`` unknown rather than counting lines."""
    out: dict[str, Total | None] = {}
    total: Total | None = None
    for i, spec in enumerate(specs):
        node = nodes[i] if i < len(nodes) else None
        kind, name = spec.kind, spec.name
        if spec.placement == "source":
            if isinstance(node, Mix):
                for inner_key, _, inner_nodes in node.sources():
                    inner_specs = spec.options["pipelines"][inner_key].stages
                    out.update(chain_totals(inner_nodes, inner_specs, node.ctx, count_files))
                total = _mix_total(spec, node, count_files)
            else:
                length = getattr(node, "length", None)
                n = length() if callable(length) else None
                total = None if n is None else Total(int(n))
        elif kind == "dispatch" or total is None:
            pass
        elif kind in FILE_READERS:
            total = _reader_total(specs, nodes, i, count_files)
        elif node is not None:
            total = node.out_total(total)  # each central kind's own rule
        elif kind in WORKER_KINDS:
            total = WORKER_KINDS[kind].out_total(total, name)
        else:
            total = None
        out[name] = total
    return out


def first_unknown(totals: dict[str, Total | None], names: Sequence[str]) -> str | None:
    """The first of ``names`` whose total is unknown."""
    return next((name for name in names if totals.get(name) is None), None)


def exact_length(totals: dict[str, Total | None], names: Sequence[str]) -> int:
    """``len()`` of a pipeline whose stages are ``names``: its last stage's
    exact total, else ``TypeError`` naming the stage that makes it unknown."""
    total = totals[names[-1]]
    if total is None:
        blocker = first_unknown(totals, names)
        msg = (
            f"the length of this pipeline is not known without iterating: stage "
            f"'{blocker}' changes the number of items or has no length."
        )
        raise TypeError(msg)
    if not total.exact:
        msg = (
            f"the length of this pipeline is not known without iterating: stage "
            f"'{total.bound_by}' may drop or merge items, so only an upper bound of "
            f"{total.items} is known (loader.total())."
        )
        raise TypeError(msg)
    return total.items
