"""Loader configuration: frozen, keyword-only ``attrs`` classes with validators.

Every invalid value raises :class:`~centralpipe.errors.ConfigError` (a
``ValueError``) naming the field, the value and the allowed range.
``LoaderConfig.to_dict()`` / ``from_dict()`` round-trip through ``cattrs``;
``from_toml()`` reads the same structure from a TOML file.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs
from attrs import validators as v

from centralpipe.errors import ConfigError
from centralpipe.validators import NUMBER, Validator, checked, int_in

__all__ = ["CENTRAL_WAIT_S", "DistributedConfig", "LoaderConfig", "WorkerConfig"]

#: Longest wait, in seconds, of ``state_dict()``, ``query()``,
#: ``load_state_dict()`` and the start of a pass for a central ``next()`` in
#: progress (a source blocked on a read, a parallel stage waiting for a hung
#: worker), after which they raise ``TimeoutError`` naming the stage, having
#: changed nothing. Read at each wait: set it on this module to change it.
CENTRAL_WAIT_S = 60.0
#: Default bound on items dispatched to workers but not yet delivered.
DEFAULT_BUFFER_SIZE = 4096
#: Default bound on the bytes of results held before their turn (256 MiB).
DEFAULT_BUFFER_BYTES = 256 * 2**20
START_METHODS = ("fork", "forkserver", "spawn")
ON_ERROR = ("raise", "skip")
EXECUTORS = ("process", "thread")
#: Where a Loader's central part runs (``LoaderConfig.central``).
CENTRAL_MODES = ("process", "service", "node")
#: Default shared memory per worker process for large result buffers.
DEFAULT_SHARED_MEMORY_BYTES = 64 * 2**20
MIN_SHARED_MEMORY_BYTES = 2**20
MAX_SHARED_MEMORY_BYTES = 2**40
#: Spelling of ``buffer_size=None`` (and ``buffer_bytes``) in formats without a null (TOML).
UNLIMITED = "unlimited"

#: Seeds are mixed as 64-bit values (:mod:`centralpipe.seeding`): a seed of
#: 2**64 or more would repeat the streams of a smaller one, so it is refused.
SEED_END = 2**64

# Field validators: attrs' own (instance_of, ge, gt, in_, optional) composed,
# each raising a ConfigError that names the field (centralpipe.validators.checked).


def _int(minimum: int) -> Validator:
    """An ``int`` (not a ``bool``) >= ``minimum``."""
    return checked(ConfigError, f"an int >= {minimum}", int_in(minimum))


def _positive_number() -> Validator:
    return checked(ConfigError, "a number > 0", NUMBER, v.gt(0))


def _choice(choices: tuple[str, ...]) -> Validator:
    return checked(ConfigError, "one of " + ", ".join(repr(c) for c in choices), v.in_(choices))


def _optional(inner: Validator) -> Validator:
    """``None`` or what ``inner`` accepts (``inner`` raises the ``ConfigError``)."""
    return v.optional(inner)


def _instance(cls: type) -> Validator:
    return checked(ConfigError, f"a {cls.__name__}", v.instance_of(cls))


def _shared_memory_bytes(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """0 (off) or at least ``MIN_SHARED_MEMORY_BYTES``."""
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not (value == 0 or MIN_SHARED_MEMORY_BYTES <= value <= MAX_SHARED_MEMORY_BYTES)
    ):
        msg = (
            f"`{attribute.name}` must be 0 (no shared memory) or an int in "
            f"[{MIN_SHARED_MEMORY_BYTES}, {MAX_SHARED_MEMORY_BYTES}] (bytes per worker), "
            f"got {value!r}."
        )
        raise ConfigError(msg)


def _unlimited_as_none(value: Any) -> Any:
    return None if value == UNLIMITED else value


@attrs.frozen(kw_only=True)
class WorkerConfig:
    """How the stages after ``dispatch()`` run.

    Attributes:
        num_workers: worker processes; 0 runs the worker stages inline in the
            main process with the same output and checkpoints.
        buffer_size: most items dispatched but not yet delivered; the feeder
            blocks (never raises) when it is reached. ``None``: unlimited.
        buffer_bytes: most bytes of results received from workers and held
            in the main process before their turn (results arrive out of
            order: one straggling item makes the others' results wait). When
            it is reached, workers that owe nothing the consumer waits for
            are not read (each waits with its result) and no new chunk is
            sent; the result waited for is always accepted, so nothing
            deadlocks and a single result larger than the bound still passes.
            Held bytes stay under the bound plus about one result per worker
            (``metrics()["dispatch"]["buffered_bytes_high_water"]``). Counted
            as received (the message size); for thread workers, estimated
            from the outputs. ``None``: unlimited (``"unlimited"`` in TOML).
        start_method: ``"fork"``, ``"forkserver"`` or ``"spawn"``; ``None``
            picks ``"forkserver"`` where available (safe with the feeder thread
            running, and Python 3.14's default on Linux), else ``"spawn"``.
        timeout_s: seconds one item may run in a worker before the worker is
            killed and the item retried once on a fresh worker.
        max_restarts: worker replacements allowed per epoch before ``WorkerError``.
        item_retries: how often an item that killed or hung a worker is tried
            again on a fresh worker before it is reported (or skipped with
            ``on_error="skip"``) as a poison item.
        on_error: ``"raise"`` a ``WorkerError``, or ``"skip"`` the item (counted
            in ``metrics()["dispatch"]["skipped"]``).
        chunk_size: items per message to a worker; ``None`` adapts it to the
            measured cost per item (more for tiny items, fewer for slow ones).
        executor: ``"process"`` (worker processes) or ``"thread"`` (worker
            threads in this process: for functions that release the GIL, such
            as Rust/C++ tokenizers, torch ops and decoders, and for
            free-threaded Python). Outputs and checkpoints are the same; a
            hung thread cannot be killed, so it is reported, not retried.
        shared_memory_bytes: size of each worker process's shared-memory ring
            (anonymous memory: nothing appears in ``/dev/shm``). Tensor and
            numpy memory of 16 KiB and more in results is written there and
            copied out once in the main process, instead of going through the
            pipe; what does not fit at the moment goes through the pipe. 0
            sends everything through the pipe; else at least 1 MiB (default
            64 MiB; memory is only used as results need it). Ignored by the
            thread executor and where ``os.memfd_create`` is missing.
        start_inline: off by default: with ``num_workers > 0`` user code runs
            only in the workers, and the first ``next()`` waits for them
            (they start in the background when the Loader is created). On,
            while the worker processes of a ``forkserver`` or ``spawn`` pool
            are still starting (they import what the workers need, torch
            often: a second or more), the main process runs the worker stages
            of the first chunks itself and hands the next chunks to the
            workers as soon as every one is ready. Those chunks go through
            the very serialisation the workers use (items out, results back),
            so output, seeds, ``on_error``, errors and checkpoints are those
            of the workers whoever ran an item; only the isolation is lost: a
            crash (``os._exit``, a segfault) or hang of the function hits the
            main process, and so do its CUDA context, memory and threads. So
            it is never done when ``timeout_s`` is set (a hung item could not
            be stopped), for stateful worker stages (their state would be
            split), with ``fork`` (workers start in milliseconds) or the
            thread executor.
        read_in_workers: on by default: a parallel stage that reads straight
            from ``read_lines`` of local files, run on workers, is sent byte
            ranges of the files instead of lines, and each worker reads and
            splits its range itself (lines never cross to the workers; the
            main process only finds each range's end and counts its lines).
            Output, errors, queries and checkpoints are the same either way,
            and a checkpoint resumes with it on or off. ``False`` sends the
            lines. No effect with ``num_workers=0``.
        flat_arrays: on by default: a list of 1-D numpy arrays or tensors of
            one dtype (a chunk of a tokenizer's outputs on the way back from
            the workers; a bucket or batch of them on the way to the worker
            stages) crosses as one flat buffer plus offsets instead of one
            pickle per array; each item arrives as a view of that buffer,
            with the same type, dtype, values and writability. Off: every
            array is pickled on its own (same items, same checkpoints).
        fuse_parallel: on by default: consecutive ``parallel=True`` stages
            with nothing central between them (maps and filters; a
            ``flat_map`` keeps its own stream) are one *segment*: one round
            trip to a worker that runs their functions in turn, instead of
            one per stage. A stage with ``with_rng=True`` starts a new
            segment. Output, errors, queries and checkpoints (still one
            entry per stage) are the same either way, and a checkpoint
            resumes with it on or off. ``False``: one stream per stage.
    """

    num_workers: int = attrs.field(default=0, validator=_int(0))
    buffer_size: int | None = attrs.field(
        default=DEFAULT_BUFFER_SIZE, converter=_unlimited_as_none, validator=_optional(_int(1))
    )
    buffer_bytes: int | None = attrs.field(
        default=DEFAULT_BUFFER_BYTES, converter=_unlimited_as_none, validator=_optional(_int(1))
    )
    start_method: str | None = attrs.field(
        default=None, validator=_optional(_choice(START_METHODS))
    )
    timeout_s: float | None = attrs.field(default=None, validator=_optional(_positive_number()))
    max_restarts: int = attrs.field(default=3, validator=_int(0))
    item_retries: int = attrs.field(default=1, validator=_int(0))
    on_error: str = attrs.field(default="raise", validator=_choice(ON_ERROR))
    chunk_size: int | None = attrs.field(default=None, validator=_optional(_int(1)))
    executor: str = attrs.field(default="process", validator=_choice(EXECUTORS))
    shared_memory_bytes: int = attrs.field(
        default=DEFAULT_SHARED_MEMORY_BYTES, validator=_shared_memory_bytes
    )
    start_inline: bool = attrs.field(default=False, validator=_instance(bool))
    read_in_workers: bool = attrs.field(default=True, validator=_instance(bool))
    flat_arrays: bool = attrs.field(default=True, validator=_instance(bool))
    fuse_parallel: bool = attrs.field(default=True, validator=_instance(bool))

    def resolved_start_method(self) -> str:
        """The start method workers use: the configured one or the default."""
        import multiprocessing

        if self.start_method is not None:
            return self.start_method
        available = multiprocessing.get_all_start_methods()
        return "forkserver" if "forkserver" in available else "spawn"


@attrs.frozen(kw_only=True)
class DistributedConfig:
    """This process's place among the ranks: ``shard()`` keeps index ``i`` when
    ``i % world_size == rank``. ``local_rank`` is informational."""

    rank: int = attrs.field(default=0, validator=_int(0))
    world_size: int = attrs.field(default=1, validator=_int(1))
    local_rank: int | None = attrs.field(default=None, validator=_optional(_int(0)))

    def __attrs_post_init__(self) -> None:
        if self.rank >= self.world_size:
            msg = f"`rank` must be in [0, world_size) = [0, {self.world_size}), got {self.rank}."
            raise ConfigError(msg)

    @classmethod
    def from_env(cls) -> DistributedConfig:
        """Rank and world size of this process, under any launcher.

        An initialised ``torch.distributed`` process group comes first; then
        torchrun's ``RANK``/``WORLD_SIZE`` (and ``LOCAL_RANK``); then
        ``WORLD_SIZE`` + ``LOCAL_RANK`` without ``RANK`` (Lightning's launcher)
        where the rank is unambiguous (one node, or ``NODE_RANK`` with
        ``LOCAL_WORLD_SIZE``); else rank 0 of 1. Variables that contradict the
        group, or a rank that cannot be derived for sure, are a ``ConfigError``.
        """
        from centralpipe.launchers import ranks_from_env

        rank, world_size, local = ranks_from_env()
        return cls(rank=rank, world_size=world_size, local_rank=local)


@attrs.frozen(kw_only=True)
class LoaderConfig:
    """Everything a :class:`~centralpipe.Loader` needs besides the pipeline.

    Attributes:
        workers: how the worker stages run (:class:`WorkerConfig`).
        distributed: this process's rank and the world size.
        seed: an int in ``[0, 2**64)``. Every random stream (``shuffle``,
            ``map(..., with_rng=True)``) is derived from ``(seed, epoch, ...)``
            mixed as 64-bit values: a larger seed would repeat the streams of
            one in the range (``2**64`` those of ``0``) and is refused. In the
            range, the mix is a 64-bit bijection cut to 63 bits, so two seeds
            share a stream only by a 2**-63 chance.
        pin_memory: pin the tensors of delivered items for the current
            accelerator (``torch.accelerator``, the device current when the
            Loader is created), in a background thread; with no accelerator,
            or on MPS, warn once and do nothing.
        central: where the central stages, the dispatch and the worker pool
            run: ``"process"`` (default) in the training process;
            ``"service"`` in one helper process for this Loader, the training
            process keeping a thin client that receives the outputs through
            shared memory; ``"node"`` in one helper process per node shared
            by the node's local ranks (torchrun's ``LOCAL_RANK`` and
            ``LOCAL_WORLD_SIZE``), which runs the stages before ``shard()``
            once for all of them. Same API, same checkpoints (a state saved
            in one mode resumes in the others).
    """

    workers: WorkerConfig = attrs.field(factory=WorkerConfig, validator=_instance(WorkerConfig))
    distributed: DistributedConfig = attrs.field(
        factory=DistributedConfig, validator=_instance(DistributedConfig)
    )
    seed: int = attrs.field(
        default=0, validator=checked(ConfigError, "an int in [0, 2**64)", int_in(0, SEED_END))
    )
    pin_memory: bool = attrs.field(default=False, validator=_instance(bool))
    central: str = attrs.field(default="process", validator=_choice(CENTRAL_MODES))

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict of builtins; ``from_dict`` reverses it."""
        out: dict[str, Any] = _CONVERTER.unstructure(self)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoaderConfig:
        """Build from a nested mapping; missing keys take defaults, unknown keys
        are a ``ConfigError``."""
        if not isinstance(data, Mapping):
            msg = f"a LoaderConfig dict must be a mapping, got {type(data).__name__}."
            raise ConfigError(msg)
        for section in ("workers", "distributed"):
            if section in data and not isinstance(data[section], Mapping):
                msg = (
                    f"`{section}` must be a table/dict of {section} settings, "
                    f"got {type(data[section]).__name__} {data[section]!r}."
                )
                raise ConfigError(msg)
        try:
            return _CONVERTER.structure(dict(data), cls)
        except ConfigError:
            raise
        except Exception as exc:  # cattrs wraps errors in exception groups
            raise _config_error_from(exc) from None

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> LoaderConfig:
        """Load from a TOML file with ``[workers]`` and ``[distributed]`` tables
        and a top-level ``seed``; write ``buffer_size = "unlimited"`` (or
        ``buffer_bytes``) for ``None``."""
        with Path(path).open("rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as exc:
                msg = f"{path}: not valid TOML: {exc}"
                raise ConfigError(msg) from None
            except UnicodeDecodeError as exc:
                msg = (
                    f"{path}: not valid TOML: TOML files are UTF-8, but byte {exc.start} "
                    f"({exc.object[exc.start : exc.start + 1]!r}) is not: {exc.reason}; "
                    "save the file as UTF-8."
                )
                raise ConfigError(msg) from None
        return cls.from_dict(data)


def _config_error_from(exc: BaseException) -> ConfigError:
    """The most useful leaf of a cattrs error tree, as a ``ConfigError``."""
    leaves: list[tuple[str, BaseException]] = []

    def walk(e: BaseException, path: str) -> None:
        if isinstance(e, BaseExceptionGroup):
            notes = getattr(e, "__notes__", [])
            for sub in e.exceptions:
                sub_notes = getattr(sub, "__notes__", []) or notes
                where = path
                for note in sub_notes:
                    if isinstance(note, str) and "attribute" in note:
                        where = f"{path}.{note.split()[-1]}" if path else note.split()[-1]
                walk(sub, where)
        else:
            leaves.append((path, e))

    walk(exc, "")
    for _, leaf in leaves:
        if isinstance(leaf, ConfigError):
            return leaf
    for _, leaf in leaves:
        if isinstance(leaf, cattrs.ForbiddenExtraKeysError):
            keys = ", ".join(sorted(repr(k) for k in leaf.extra_fields))
            known = ", ".join(f.name for f in attrs.fields(leaf.cl))
            where = f" in {leaf.cl.__name__}" if leaf.cl is not None else ""
            return ConfigError(f"unknown key(s) {keys}{where}; known keys: {known}.")
    path, leaf = leaves[0] if leaves else ("", exc)
    where = f"`{path.strip('`')}`: " if path else ""
    return ConfigError(f"invalid config: {where}{type(leaf).__name__}: {leaf}")


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)

    # Configs are validated by attrs; pass raw values through untouched so a
    # wrong type reaches the validator (and becomes a ConfigError) instead of
    # being coerced by cattrs (``int("3")``).
    def passthrough(value: Any, _type: Any) -> Any:
        return value

    conv.register_structure_hook_func(lambda tp: not attrs.has(tp), passthrough)
    # cattrs dispatches primitive classes before predicate hooks: override them too.
    for primitive in (int, float, str, bool, bytes):
        conv.register_structure_hook(primitive, passthrough)
    return conv


_CONVERTER = _make_converter()
