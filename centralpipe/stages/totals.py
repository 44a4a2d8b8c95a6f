"""Known totals: how many items each stage yields per epoch, without iterating.

:func:`chain_totals` walks a plan and gives each stage a :class:`Total` (an
item count, *exact* or only an *upper bound*) or ``None`` (unknown). The rules:

Each central kind's rule is its node class's ``out_total`` (the kind's one
home), each worker kind's is in ``plan.kinds.WORKER_KINDS``; sources and
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

:func:`weight_total` gives a ``count`` stage's summed weight per epoch
(``loader.total(name, weight=True)``, a progress bar's end), where the plan
alone tells it, never guessing:

- no ``weight_fn``: the weight counts items, so it is the stage's item total;
- ``weight_fn=len`` (the builtin) on the lists of a ``batch``,
  ``bucket_by_max_tokens`` or ``pack`` (only ``count`` and ``shuffle`` stages
  between, which pass the lists on unchanged): the items going into that
  stage, as their total says (exact or an upper bound). ``batch`` with
  ``drop_last`` keeps ``batch_size`` times its batches; a bucket with
  ``min_len > 0`` or a ``max_len``, and ``pack(oversize="drop")``, may drop
  items, so their sum is an upper bound set by that stage;
- any other ``weight_fn`` (a ``lambda``, token lengths …), a stage inside a
  ``mix``, or an unknown input total: unknown (``None``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from centralpipe.plan.kinds import WORKER_KINDS
from centralpipe.plan.options import BatchOptions, BucketOptions, MixOptions, PackOptions
from centralpipe.plan.specs import StageSpec
from centralpipe.stages.base import RunContext, Total
from centralpipe.stages.files import count_lines
from centralpipe.stages.mix import Mix
from centralpipe.stages.sources import FilesSource

__all__ = ["Total", "chain_totals", "exact_length", "first_unknown", "weight_total"]

#: Stages between a grouping stage and a count that pass its lists on unchanged.
SAME_ITEMS = ("count", "shuffle")
#: Stages whose outputs are lists of their inputs.
GROUPING = ("batch", "bucket_by_max_tokens", "pack")
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
    options = spec.options_as(MixOptions)
    stop = options.stop
    if stop == "never":
        return None
    exact = stop == "all_exhausted"
    items, bound_by = 0, None if exact else spec.name
    for key, weight, nodes in node.sources():
        if weight <= 0:
            continue
        sub = chain_totals(nodes, options.pipelines[key].stages, node.ctx, count_files)
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
                    inner_specs = spec.options_as(MixOptions).pipelines[inner_key].stages
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


def weight_total(
    specs: Sequence[StageSpec], totals: dict[str, Total | None], name: str
) -> Total | None:
    """The summed weight ``count`` stage ``name`` reaches in one epoch, when
    the plan tells it (see the module docstring), else ``None``. ``totals``
    are :func:`chain_totals` of the same plan; ``Total.items`` holds the sum."""
    at = next((i for i, spec in enumerate(specs) if spec.name == name), None)
    if at is None:  # inside a mix: its stages' lists are not followed here
        return None
    count = specs[at]
    if count.fn is None:
        return totals.get(name)
    if count.fn is not len:
        return None
    j = at - 1
    while j > 0 and specs[j].kind in SAME_ITEMS:
        j -= 1
    group = specs[j]
    if j < 1 or group.kind not in GROUPING or group.parallel:
        return None
    into = totals.get(specs[j - 1].name)
    if into is None:
        return None
    if group.kind == "batch":
        batch = group.options_as(BatchOptions)
        if not batch.drop_last:
            return into
        size = batch.batch_size
        return Total(into.items // size * size, into.exact, into.bound_by)
    if group.kind == "bucket_by_max_tokens":
        bucket = group.options_as(BucketOptions)
        drops = bucket.min_len > 0 or bucket.max_len is not None
        return into.at_most(group.name) if drops else into
    drops = group.options_as(PackOptions).oversize == "drop"
    return into.at_most(group.name) if drops else into
