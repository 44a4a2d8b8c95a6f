"""Field validators for the attrs classes (configs, checkpoint model, stage states).

They are attrs' own validators (``instance_of``, ``ge``, ``lt``, ``in_``,
``optional``, ``deep_iterable``) composed with ``and_``; :func:`checked` runs
them and turns any failure into one error naming the field, what was expected
and what was got: ``checked(ConfigError, "an int >= 0", INT, ge(0))`` raises
``ConfigError("`num_workers` must be an int >= 0, got -1.")``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from attrs import validators as v

__all__ = [
    "INT",
    "NUMBER",
    "FieldError",
    "Validator",
    "checked",
    "int_in",
    "sequence_of",
    "short_repr",
]

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]

#: An ``int`` that is not a ``bool``.
INT: Validator = v.and_(v.instance_of(int), v.not_(v.instance_of(bool)))
#: An ``int`` or ``float`` that is not a ``bool``.
NUMBER: Validator = v.and_(v.instance_of((int, float)), v.not_(v.instance_of(bool)))


class FieldError(ValueError):
    """A field's value is not what it must be (the checkpoint model's error;
    :mod:`centralpipe.checkpoint` adds the key path)."""

    def __init__(self, field: str, expected: str, value: Any) -> None:
        self.field = field
        self.expected = expected
        self.value = value
        super().__init__(f"`{field}` must be {expected}, got {short_repr(value)}.")


def short_repr(value: Any) -> str:
    """``repr(value)``, cut to a type name and 60 characters when longer than 80
    (for error messages)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{type(value).__name__} {text[:60]}..."


def checked(error: type[Exception], expected: str, *validators: Validator) -> Validator:
    """All ``validators`` in order; the first failure raises ``error`` saying
    "`field` must be ``expected``, got value." (``FieldError`` gets the parts)."""
    composed = v.and_(*validators)

    def check(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        try:
            composed(inst, attribute, value)
        except (TypeError, ValueError):
            if error is FieldError:
                raise FieldError(attribute.name, expected, value) from None
            got = short_repr(value)
            raise error(f"`{attribute.name}` must be {expected}, got {got}.") from None

    return check


def int_in(low: int, high: int | None = None) -> Validator:
    """An ``int`` (not ``bool``) with ``low <= value`` (and ``value < high``)."""
    parts = [INT, v.ge(low)]
    if high is not None:
        parts.append(v.lt(high))
    return v.and_(*parts)


def sequence_of(member: Validator | None = None) -> Validator:
    """A list or tuple (not a str), each member passing ``member``."""
    outer = v.instance_of((list, tuple))
    if member is None:
        return outer
    return v.deep_iterable(member_validator=member, iterable_validator=outer)
