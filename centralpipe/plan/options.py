"""The typed options of every stage kind: the shared base, and one class per
central kind (the per-item kinds' are in :mod:`centralpipe.plan.kinds`).

A stage's options are an attrs frozen class read as attributes
(``spec.options.batch_size``) that is also a read-only mapping of the options
as the builder records them, equal to the dict it replaces: ``describe()``,
fingerprints, pickles and checkpoints read the same. :data:`CENTRAL_OPTIONS`
names the class of each central kind; :class:`~centralpipe.plan.specs.StageSpec`
converts the options it is given into it. The builder checks the values
(:mod:`centralpipe.plan.checks`); these classes refuse an option the kind
does not take, and the values the builder refuses that need nothing but the
value (a size, a choice), in the builder's words.

Runs in worker processes too: imports neither torch nor the builder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar

import attrs

from centralpipe.errors import PipelineError

__all__ = [
    "CENTRAL_OPTIONS",
    "EQUALIZE",
    "OVERSIZE",
    "STRATEGIES",
    "BatchOptions",
    "BucketOptions",
    "DatasetOptions",
    "FilesOptions",
    "IterableOptions",
    "MixOptions",
    "NoOptions",
    "Options",
    "PackOptions",
    "ReadJsonlOptions",
    "ReadLinesOptions",
    "ReadParquetOptions",
    "ShardOptions",
    "ShuffleOptions",
    "StatefulIterableOptions",
]

_O = TypeVar("_O", bound="Options")

#: ``shard(equalize=...)``.
EQUALIZE = (None, "drop_last", "pad")
#: ``pack(strategy=...)`` and ``pack(oversize=...)``.
STRATEGIES = ("first_fit", "best_fit")
OVERSIZE = ("raise", "drop")


# Validators for what the builder checks too, with its words: a hand-made
# spec is refused as the builder refuses it (``from_mapping`` names the stage).
def _at_least(minimum: int) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            msg = f"`{attribute.name}` must be an int >= {minimum}, got {value!r}."
            raise PipelineError(msg)

    return check


def _one_of(choices: tuple[Any, ...]) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            msg = f"`{attribute.name}` must be one of {choices}, got {value!r}."
            raise PipelineError(msg)

    return check


def _equalize(_inst: Any, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in EQUALIZE:
        msg = f"`equalize` must be None, 'drop_last' or 'pad', got {value!r}."
        raise PipelineError(msg)


@attrs.frozen(kw_only=True, eq=False)
class Options(Mapping[str, Any]):
    """The typed options of one stage kind; read as attributes.

    Also a read-only mapping of the options as the builder records them:
    each option the kind takes (``TAKES``, in that order) that is set (not
    its default), and those in ``SHOWN`` always. It compares equal to a dict
    of the same items. Setting a field the kind does not take is a
    ``PipelineError``."""

    #: Options this kind takes, in the order the mapping lists them.
    TAKES: ClassVar[tuple[str, ...]] = ()
    #: Options the mapping lists even when at their default.
    SHOWN: ClassVar[tuple[str, ...]] = ()

    def __attrs_post_init__(self) -> None:
        for field in attrs.fields(type(self)):
            if field.name not in self.TAKES and getattr(self, field.name) != field.default:
                takes = ", ".join(self.TAKES) or "none"
                msg = f"`{field.name}` is not an option of this stage kind (its options: {takes})."
                raise PipelineError(msg)

    @classmethod
    def from_mapping(cls: type[_O], options: Mapping[str, Any], stage: str) -> _O:
        """The options a builder (or a hand-made spec) gave as a mapping;
        ``PipelineError`` naming ``stage`` for an unknown option or a bad value."""
        if isinstance(options, cls):
            return options
        unknown = sorted(k for k in options if k not in cls.TAKES)
        if unknown:
            takes = ", ".join(cls.TAKES) or "none"
            msg = f"stage '{stage}': unknown option(s) {unknown} (its options: {takes})."
            raise PipelineError(msg)
        try:
            return cls(**options)
        except PipelineError as exc:
            raise PipelineError(f"stage '{stage}': {exc}") from None
        except TypeError as exc:  # a required option left out
            raise PipelineError(f"stage '{stage}': {exc}") from None

    def _listed(self) -> list[str]:
        fields = attrs.fields_dict(type(self))
        return [k for k in self.TAKES if k in self.SHOWN or getattr(self, k) != fields[k].default]

    def __getitem__(self, key: str) -> Any:
        if key not in self._listed():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._listed())

    def __len__(self) -> int:
        return len(self._listed())


@attrs.frozen(kw_only=True, eq=False)
class NoOptions(Options):
    """``count`` and ``dispatch``: no options."""


@attrs.frozen(kw_only=True, eq=False)
class IterableOptions(Options):
    """``Pipeline.from_iterable``: the iterable and how it is read
    (``"sequence"``: by index, else by iteration)."""

    TAKES = SHOWN = ("source", "mode")
    source: Any
    mode: str


@attrs.frozen(kw_only=True, eq=False)
class StatefulIterableOptions(Options):
    """``Pipeline.from_iterable`` of a stateful iterable: it and the state it starts from."""

    TAKES = SHOWN = ("source", "start")
    source: Any
    start: Any


@attrs.frozen(kw_only=True, eq=False)
class DatasetOptions(Options):
    """``Pipeline.from_dataset`` and ``Pipeline.from_node``: the object read."""

    TAKES = SHOWN = ("source",)
    source: Any


@attrs.frozen(kw_only=True, eq=False)
class FilesOptions(Options):
    """``Pipeline.from_files``: a ``glob`` or the ``paths``, whichever was given."""

    TAKES = ("glob", "paths")
    glob: str | None = None
    paths: tuple[str, ...] | None = None


@attrs.frozen(kw_only=True, eq=False)
class MixOptions(Options):
    """``Pipeline.mix``: each sub-pipeline's plan by key, the weights, when to stop."""

    TAKES = SHOWN = ("pipelines", "weights", "stop")
    pipelines: Mapping[str, Any]
    weights: Mapping[str, float]
    stop: str


@attrs.frozen(kw_only=True, eq=False)
class ReadLinesOptions(Options):
    """``read_lines``."""

    TAKES = SHOWN = ("encoding", "errors")
    encoding: str
    errors: str = "strict"


@attrs.frozen(kw_only=True, eq=False)
class ReadJsonlOptions(Options):
    """``read_jsonl``: ``field`` (None, a key or a callable) and ``errors``."""

    TAKES = SHOWN = ("field", "errors")
    field: str | Callable[[Any], Any] | None
    errors: str


@attrs.frozen(kw_only=True, eq=False)
class ReadParquetOptions(Options):
    """``read_parquet``."""

    TAKES = SHOWN = ("columns", "batch_rows")
    columns: tuple[str, ...] | None
    batch_rows: int | None


@attrs.frozen(kw_only=True, eq=False)
class BatchOptions(Options):
    """``batch``."""

    TAKES = SHOWN = ("batch_size", "drop_last")
    batch_size: int = attrs.field(validator=_at_least(1))
    drop_last: bool


@attrs.frozen(kw_only=True, eq=False)
class BucketOptions(Options):
    """``bucket_by_max_tokens`` (its ``len_fn`` is the spec's function)."""

    TAKES = SHOWN = ("max_tokens", "buffer_size", "min_len", "max_len", "include_padding")
    max_tokens: int = attrs.field(validator=_at_least(1))
    buffer_size: int | None = attrs.field(validator=attrs.validators.optional(_at_least(1)))
    min_len: int = attrs.field(validator=_at_least(0))
    max_len: int | None
    include_padding: bool


@attrs.frozen(kw_only=True, eq=False)
class PackOptions(Options):
    """``pack`` (its ``len_fn`` is the spec's function)."""

    TAKES = SHOWN = ("max_tokens", "strategy", "buffer_size", "oversize")
    max_tokens: int = attrs.field(validator=_at_least(1))
    strategy: str = attrs.field(validator=_one_of(STRATEGIES))
    buffer_size: int = attrs.field(validator=_at_least(1))
    oversize: str = attrs.field(validator=_one_of(OVERSIZE))


@attrs.frozen(kw_only=True, eq=False)
class ShuffleOptions(Options):
    """``shuffle``."""

    TAKES = SHOWN = ("buffer_size",)
    buffer_size: int = attrs.field(validator=_at_least(1))


@attrs.frozen(kw_only=True, eq=False)
class ShardOptions(Options):
    """``shard``: ``equalize`` (listed even when ``None``)."""

    TAKES = SHOWN = ("equalize",)
    equalize: str | None = attrs.field(default=None, validator=_equalize)


#: The options class of each central kind, by the spec's kind string.
CENTRAL_OPTIONS: Mapping[str, type[Options]] = {
    "iterable": IterableOptions,
    "stateful_iterable": StatefulIterableOptions,
    "dataset": DatasetOptions,
    "node": DatasetOptions,
    "files": FilesOptions,
    "mix": MixOptions,
    "read_lines": ReadLinesOptions,
    "read_jsonl": ReadJsonlOptions,
    "read_parquet": ReadParquetOptions,
    "batch": BatchOptions,
    "bucket_by_max_tokens": BucketOptions,
    "pack": PackOptions,
    "shuffle": ShuffleOptions,
    "count": NoOptions,
    "shard": ShardOptions,
    "dispatch": NoOptions,
}
