"""Deterministic fault injection for the soak: interrupts and damaged checkpoints.

:class:`Interrupts` raises ``KeyboardInterrupt`` in the calling thread inside
a call, at the entry of the ``k``-th Python function (or generator
resumption) of centralpipe's own code the call runs (see ``_PACKAGE_DIR``),
``k`` drawn from a seeded ``random.Random``: the same seed lands the interrupt
at the same point of the same code path. It lands where a Ctrl-C does: in the
main thread, at a function's entry, where CPython checks for signals (it also
checks right after each call into C returns, which this model does not reach:
``tests/dispatch/test_real_signals.py`` sends real SIGINTs for that), and never
in the feeder, supervisor or worker threads, which a Ctrl-C never reaches. A
call that ends before its ``k``-th event is counted as *missed*.

:func:`damage` returns a copy of a checkpoint with one defect that no valid
checkpoint has: a value of the wrong type, a negative or out-of-range int, a
missing or unknown key, a section that is not a dict. Items themselves (the
in-flight items, a shuffle or bucket buffer, an RNG state) are user data that
cannot be told from other valid data, so they are never the target.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import random
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar

import attrs

from centralpipe.checkpoint.model import STAMP_KEYS

#: Only centralpipe's own code is interrupted, and not the entry and exit
#: of its context managers (``__enter__``/``__exit__``). The standard library
#: is not interrupt-atomic and no caller can make it so (a Ctrl-C that lands
#: between ``os.close`` and the bookkeeping after it in
#: ``Connection.close``, inside ``Process.close`` or at the start of
#: ``Condition.__exit__`` leaves a closed fd marked open, a half-closed process
#: object or a lock held): an interrupt due there lands at the next event in
#: centralpipe's code instead.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # centralpipe/
_SHIELDED_NAMES = frozenset({"__enter__", "__exit__"})


def _shielded(frame: FrameType) -> bool:
    code = frame.f_code
    return not code.co_filename.startswith(_PACKAGE_DIR) or code.co_name in _SHIELDED_NAMES


__all__ = ["DAMAGE_KINDS", "Injected", "Interrupts", "damage"]

T = TypeVar("T")

#: Interrupts land at a log-uniform event index in [1, MAX_EVENTS]: early
#: and deep points of short calls and of long ones (a first ``next()`` that
#: starts workers runs thousands of events).
MAX_EVENTS = 5_000
#: Keys whose values are user data (items, buffers, RNG state): never damaged.
PAYLOAD_KEYS = frozenset(
    {
        "items",
        "buffer",
        "heap",
        "batch",
        "held",
        "ready",
        "pending",
        "round",
        "queue",
        "rng",
        "stamps",
    }
)
#: Keys of lists of ``[room, [items]]`` (``pack``'s open groups): the rooms are
#: checked, the items are user data.
GROUP_KEYS = frozenset({"groups"})
#: Keys whose values may legitimately be any number (``count`` weights); the
#: totals in stamps hold weights too, so numbers there only get a wrong type.
ANY_NUMBER_KEYS = frozenset({"weight"})
DAMAGE_KINDS = (
    "wrong-type",
    "negative",
    "out-of-range",
    "missing-key",
    "unknown-key",
    "not-a-dict",
)


class Injected(KeyboardInterrupt):
    """The interrupt :class:`Interrupts` raised (a ``KeyboardInterrupt``)."""


class Interrupts:
    """Seeded ``KeyboardInterrupt`` injection; see the module docstring.

    ``landed`` and ``missed`` count per place name; ``converted`` lists landed
    interrupts that surfaced as another exception or were swallowed (bugs:
    Ctrl-C must reach the caller as ``KeyboardInterrupt``).
    """

    def __init__(self, rng: random.Random, enabled: bool = True) -> None:
        self.rng = rng
        self.enabled = enabled
        self.landed: Counter[str] = Counter()
        self.missed: Counter[str] = Counter()
        self.converted: Counter[str] = Counter()

    def call(self, where: str, fn: Callable[[], T], max_events: int = MAX_EVENTS) -> T:
        """``fn()`` with an interrupt at a log-uniform random event in
        ``[1, max_events]``; re-raised when it lands. Disabled: ``fn()``."""
        if not self.enabled:
            return fn()
        k = int(math.exp(self.rng.uniform(0.0, math.log(max_events))))
        fired = False
        count = 0
        pid = os.getpid()

        def trace(frame: FrameType, event: str, arg: Any) -> Any:
            nonlocal count, fired
            if os.getpid() != pid:  # a worker forked meanwhile inherited the hook
                sys.settrace(None)
                return None
            if event != "call":
                return None  # no line events: only function entries count
            count += 1
            if count >= k and not fired and not _shielded(frame):
                fired = True
                sys.settrace(None)
                if os.environ.get("SOAK_VERBOSE"):
                    print(
                        f"soak: interrupt in {where} at {frame.f_code.co_filename}:"
                        f"{frame.f_lineno} {frame.f_code.co_name} ({event})",
                        file=sys.stderr,
                        flush=True,
                    )
                raise Injected(f"soak: injected interrupt in {where} at event {count}")
            return trace

        previous = sys.gettrace()
        sys.settrace(trace)
        try:
            result = fn()
        except Injected:
            self.landed[where] += 1
            raise
        except BaseException as exc:
            if fired:
                self.landed[where] += 1
                self.converted[f"{where}: {type(exc).__name__}: {exc}"[:200]] += 1
            raise
        finally:
            sys.settrace(previous)
        if fired:  # swallowed: the call went on as if never interrupted
            self.landed[where] += 1
            self.converted[f"{where}: swallowed"] += 1
        else:
            self.missed[where] += 1
        return result


def _targets(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every (path, value) of a checkpoint outside user data."""
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            if (key in PAYLOAD_KEYS and not isinstance(value, (int, bool))) or value is None:
                continue
            yield from _targets(value, (*path, key))
    elif isinstance(node, (list, tuple)):
        group = len(path) >= 2 and path[-2] in GROUP_KEYS
        for i, value in enumerate(node):
            if group and i == 1:  # a pack group's items
                continue
            yield from _targets(value, (*path, i))


@functools.cache
def optional_keys() -> frozenset[str]:
    """Keys the checkpoint model (and each stage's state class) gives a
    default: a checkpoint without them is valid, so removing one is no defect."""
    from centralpipe import checkpoint
    from centralpipe.stages import base

    classes: list[Any] = [
        checkpoint.Checkpoint,
        checkpoint.Distributed,
        checkpoint.Position,
        checkpoint.Boundary,
    ]
    pending = list(base.CentralNode.__subclasses__())
    while pending:
        node = pending.pop()
        pending.extend(node.__subclasses__())
        if node.State is not None and attrs.has(node.State):
            classes.append(node.State)
    return frozenset(
        f.name for cls in classes for f in attrs.fields(cls) if f.default is not attrs.NOTHING
    )


def _options(path: tuple[Any, ...], value: Any) -> list[tuple[str, Any]]:
    """The defects a value at ``path`` can be given."""
    key = path[-1] if path else None
    if isinstance(value, dict):
        out: list[tuple[str, Any]] = [("unknown-key", None)]
        if any(k not in optional_keys() for k in value):
            out.append(("missing-key", None))
        if path:
            out.append(("not-a-dict", [value]))
        return out
    if isinstance(value, bool):
        return [("wrong-type", "yes")]
    if isinstance(value, int):
        if key in ANY_NUMBER_KEYS or any(k in STAMP_KEYS for k in path):
            return [("wrong-type", str(value))]
        return [("wrong-type", str(value)), ("negative", -1 - value), ("out-of-range", 2**64)]
    if isinstance(value, float):
        return [("wrong-type", str(value))]
    if isinstance(value, str):
        return [("wrong-type", 7)]
    if isinstance(value, (list, tuple)):
        return [("wrong-type", "x")]
    return []


def _replaced(node: Any, path: tuple[Any, ...], new: Any) -> Any:
    """``node`` with the value at ``path`` replaced (tuples rebuilt)."""
    if not path:
        return new
    key, rest = path[0], path[1:]
    if isinstance(node, tuple):
        items = list(node)
        items[key] = _replaced(items[key], rest, new)
        return tuple(items)
    node[key] = _replaced(node[key], rest, new)
    return node


def damage(state: dict[str, Any], rng: random.Random) -> tuple[dict[str, Any], str]:
    """A deep copy of ``state`` with one random defect, and its description."""
    candidates = [(p, v) for p, v in _targets(state) if _options(p, v)]
    path, value = rng.choice(candidates)
    kind, new = rng.choice(_options(path, value))
    if kind == "unknown-key":
        new = {**value, "soak_unknown_key": 1}
    elif kind == "missing-key":
        gone = rng.choice(sorted((k for k in value if k not in optional_keys()), key=str))
        new = {k: v for k, v in value.items() if k != gone}
    bad = _replaced(copy.deepcopy(state), path, new)
    where = "".join(f"[{k!r}]" for k in path) or "<root>"
    return bad, f"{kind} at {where}"
