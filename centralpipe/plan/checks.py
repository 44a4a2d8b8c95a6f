"""The builder's argument checks: each raises ``PipelineError`` naming the
stage, what was expected and what was got.

The checks shared by every builder method (a name, a callable, an int) and
those of one stage kind's arguments, which return the typed options its
spec records (:mod:`centralpipe.plan.options`).
:mod:`centralpipe.plan.pipeline` calls them; the checks that depend on
where a stage goes in the pipeline (before or after ``dispatch()``) are
given that position, never the pipeline.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from centralpipe.errors import PipelineError
from centralpipe.plan.kinds import WORKER_KINDS, ItemOptions
from centralpipe.plan.options import (
    BucketOptions,
    PackOptions,
    ReadJsonlOptions,
    ReadLinesOptions,
    ReadParquetOptions,
)
from centralpipe.plan.specs import EQUALIZE, OVERSIZE, STRATEGIES, Placement

__all__ = [
    "DECODE_ERRORS",
    "bucket_options",
    "check_callable",
    "check_count",
    "check_decode_errors",
    "check_equalize",
    "check_int",
    "check_line_encoding",
    "check_name",
    "check_placement",
    "is_sequence_like",
    "item_options",
    "pack_options",
    "read_jsonl_options",
    "read_lines_options",
    "read_parquet_options",
]

#: Every ASCII character: an encoding that writes them as ASCII bytes can be split on b"\n".
_ASCII = "".join(map(chr, range(128)))


def check_callable(fn: Any, what: str, name: str) -> None:
    if not callable(fn):
        msg = f"stage '{name}': {what} must be callable, got {type(fn).__name__} {fn!r}."
        raise PipelineError(msg)


def check_int(value: Any, what: str, name: str, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        msg = f"stage '{name}': `{what}` must be an int >= {minimum}, got {value!r}."
        raise PipelineError(msg)


def check_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        msg = f"a stage name must be a non-empty str, got {name!r}."
        raise PipelineError(msg)


#: ``open()``'s ``errors`` that decode (``xmlcharrefreplace`` and ``namereplace`` only encode).
DECODE_ERRORS = ("strict", "replace", "ignore", "backslashreplace", "surrogateescape")


def check_decode_errors(errors: Any, stage: str) -> None:
    """``errors`` is one of ``open()``'s choices that decode bytes."""
    if errors not in DECODE_ERRORS:
        choices = ", ".join(repr(e) for e in DECODE_ERRORS)
        msg = f"stage '{stage}': `errors` must be one of {choices} (as open()), got {errors!r}."
        raise PipelineError(msg)


def check_line_encoding(encoding: Any, stage: str) -> None:
    """``read_lines`` splits bytes on ``b"\\n"``: the encoding must be a text
    encoding that writes ASCII as ASCII."""
    if not isinstance(encoding, str):
        raise PipelineError(f"stage '{stage}': `encoding` must be a str, got {encoding!r}.")
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise PipelineError(f"stage '{stage}': unknown encoding {encoding!r}.") from None
    try:
        "".encode(encoding)
    except LookupError:  # a codec such as "rot13" or "hex"
        msg = f"stage '{stage}': {encoding!r} is not a text encoding (e.g. 'utf-8')."
        raise PipelineError(msg) from None
    try:
        # utf-8-sig writes a BOM first and is otherwise UTF-8.
        encoded = _ASCII.encode(encoding).removeprefix(codecs.BOM_UTF8)
        ascii_compatible = encoded == _ASCII.encode("ascii")
    except (UnicodeError, LookupError, TypeError):
        ascii_compatible = False
    if not ascii_compatible:
        # Lines are found by splitting the bytes on b"\n", which in UTF-16/32
        # (and EBCDIC, UTF-7, bytes-to-bytes codecs) is not a line end.
        msg = (
            f"stage '{stage}': read_lines needs an ASCII-compatible text encoding (it splits "
            f"each file's bytes on b'\\n'), and {encoding!r} is not one. Convert the files "
            "to UTF-8, or read whole files with .map(lambda p: open(p, "
            f"encoding={encoding!r}).read().splitlines()) and .flat_map."
        )
        raise PipelineError(msg)


def is_sequence_like(obj: Any) -> bool:
    """Indexable with a length, but not a mapping (dict keys are not indices)."""
    return (
        hasattr(obj, "__len__")
        and hasattr(obj, "__getitem__")
        and not isinstance(obj, Mapping)
        and not callable(obj)
        and type(obj).__module__ == "builtins"
    )


def check_placement(kind: str, stage: str, placement: Placement, dispatch_name: str | None) -> None:
    """A central stage comes before ``dispatch()`` and a worker-only one
    (``collate``) after it; ``dispatch_name``: the pipeline's (``None``: none yet)."""
    if placement == "central" and dispatch_name is not None:
        msg = (
            f"stage '{stage}': {kind}() is a central (stateful) stage and cannot come after "
            f"dispatch() ('{dispatch_name}'); move it before .dispatch(). Only map, "
            "filter, flat_map and collate run in workers."
        )
        raise PipelineError(msg)
    if placement == "worker" and dispatch_name is None:
        msg = (
            f"stage '{stage}': {kind}() is a worker stage; call dispatch() first "
            "(or use map() for a central function)."
        )
        raise PipelineError(msg)


# -- one stage kind's arguments ------------------------------------------------------------


def read_lines_options(encoding: Any, errors: Any, stage: str) -> ReadLinesOptions:
    """The options of ``read_lines(encoding=, errors=)``."""
    check_line_encoding(encoding, stage)
    check_decode_errors(errors, stage)
    return ReadLinesOptions(encoding=encoding, errors=errors)


def item_options(
    kind: str,
    stage: str,
    *,
    central: bool,
    dispatch_name: str | None,
    parallel: Any = False,
    with_rng: Any = False,
    batched: Any = False,
) -> ItemOptions:
    """The typed options of a ``map``/``filter``/``flat_map`` built before
    ``dispatch()`` (``central``) or after it (``dispatch_name``)."""
    for flag, value in (("parallel", parallel), ("with_rng", with_rng)):
        if not isinstance(value, bool):
            raise PipelineError(f"stage '{stage}': `{flag}` must be a bool, got {value!r}.")
    if parallel and not central:
        msg = (
            f"stage '{stage}': parallel=True is for stages before dispatch(); after "
            f"dispatch() ('{dispatch_name}') {kind}() already runs in the workers."
        )
        raise PipelineError(msg)
    if with_rng and central and not parallel:
        msg = (
            f"stage '{stage}': with_rng=True is for worker maps (after dispatch()) and "
            "parallel maps: pass parallel=True; an inline central map sees items in a "
            "fixed order and can keep its own seeded generator."
        )
        raise PipelineError(msg)
    if not isinstance(batched, bool):
        raise PipelineError(f"stage '{stage}': `batched` must be a bool, got {batched!r}.")
    if batched:
        if with_rng:
            msg = (
                f"stage '{stage}': batched=True and with_rng=True do not go together (a "
                "generator is per item); draw per-item seeds inside fn, or drop batched."
            )
            raise PipelineError(msg)
        if central and not parallel:
            msg = (
                f"stage '{stage}': batched=True is for maps that run in the workers: pass "
                "parallel=True, or build the map after dispatch()."
            )
            raise PipelineError(msg)
    options = WORKER_KINDS[kind].options
    try:
        return options(parallel=parallel, with_rng=with_rng, batched=batched)
    except PipelineError as exc:  # an option this kind does not take
        raise PipelineError(f"stage '{stage}': {exc}") from None


def read_jsonl_options(field: Any, errors: Any, stage: str) -> ReadJsonlOptions:
    """The options of ``read_jsonl(field=, errors=)``."""
    if field is not None and not isinstance(field, str) and not callable(field):
        msg = (
            f"stage '{stage}': `field` must be None, a str (a key of each record) or a "
            f"callable (record -> item), got {field!r}."
        )
        raise PipelineError(msg)
    if errors not in ("strict", "skip"):
        msg = f"stage '{stage}': `errors` must be 'strict' or 'skip', got {errors!r}."
        raise PipelineError(msg)
    return ReadJsonlOptions(field=field, errors=errors)


def read_parquet_options(columns: Any, batch_rows: Any, stage: str) -> ReadParquetOptions:
    """The options of ``read_parquet(columns=, batch_rows=)`` (pyarrow installed)."""
    import importlib.util

    if importlib.util.find_spec("pyarrow") is None:
        msg = (
            f"stage '{stage}': read_parquet needs the optional package 'pyarrow'; "
            "install it with: pip install 'centralpipe[parquet]'."
        )
        raise PipelineError(msg)
    if columns is not None:
        if isinstance(columns, str) or not isinstance(columns, Sequence):
            msg = f"stage '{stage}': `columns` must be None or a list of str, got {columns!r}."
            raise PipelineError(msg)
        bad = [c for c in columns if not isinstance(c, str)]
        if bad or not columns:
            got = bad[0] if bad else "an empty list"
            msg = f"stage '{stage}': `columns` must be None or a list of str, got {got!r}."
            raise PipelineError(msg)
        columns = tuple(columns)
    if batch_rows is not None:
        check_int(batch_rows, "batch_rows", stage, 1)
    return ReadParquetOptions(columns=columns, batch_rows=batch_rows)


def bucket_options(
    max_tokens: Any,
    len_fn: Callable[[Any], int],
    buffer_size: Any,
    min_len: Any,
    max_len: Any,
    include_padding: Any,
    stage: str,
) -> BucketOptions:
    """The options of ``bucket_by_max_tokens`` (``len_fn`` is the spec's function)."""
    check_int(max_tokens, "max_tokens", stage, 1)
    check_callable(len_fn, "`len_fn`", stage)
    if buffer_size is not None:
        check_int(buffer_size, "buffer_size", stage, 1)
    check_int(min_len, "min_len", stage, 0)
    if max_len is not None:
        check_int(max_len, "max_len", stage, min_len)
    return BucketOptions(
        max_tokens=max_tokens,
        buffer_size=buffer_size,
        min_len=min_len,
        max_len=max_len,
        include_padding=bool(include_padding),
    )


def pack_options(
    max_tokens: Any,
    len_fn: Callable[[Any], int],
    strategy: Any,
    buffer_size: Any,
    oversize: Any,
    stage: str,
) -> PackOptions:
    """The options of ``pack`` (``len_fn`` is the spec's function)."""
    check_int(max_tokens, "max_tokens", stage, 1)
    check_callable(len_fn, "`len_fn`", stage)
    check_int(buffer_size, "buffer_size", stage, 1)
    if strategy not in STRATEGIES:
        msg = f"stage '{stage}': `strategy` must be one of {STRATEGIES}, got {strategy!r}."
        raise PipelineError(msg)
    if oversize not in OVERSIZE:
        msg = f"stage '{stage}': `oversize` must be one of {OVERSIZE}, got {oversize!r}."
        raise PipelineError(msg)
    return PackOptions(
        max_tokens=max_tokens, strategy=strategy, buffer_size=buffer_size, oversize=oversize
    )


def check_count(name: Any, weight_fn: Any, default_name: str) -> None:
    """``count(name, weight_fn=)``: the name first, the function by keyword."""
    if callable(name):
        fn_name = getattr(name, "__name__", "fn")
        msg = (
            f"count() takes the stage's name first and the weight function by keyword: "
            f'write .count("pre_shard", weight_fn={fn_name}), got {name!r} as the name.'
        )
        raise PipelineError(msg)
    if weight_fn is not None:
        check_callable(weight_fn, "`weight_fn`", name or default_name)


def check_equalize(equalize: Any, stage: str) -> None:
    """``shard(equalize=...)`` is one of ``EQUALIZE``."""
    if equalize not in EQUALIZE:
        msg = f"stage '{stage}': `equalize` must be None, 'drop_last' or 'pad', got {equalize!r}."
        raise PipelineError(msg)
