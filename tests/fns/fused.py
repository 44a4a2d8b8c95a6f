"""Functions for the fused parallel stage tests (importable by workers)."""

from __future__ import annotations

from typing import Any


def double(x: int) -> int:
    return x * 2


def plus_one(x: int) -> int:
    return x + 1


def double_plus_one(x: int) -> int:
    return x * 2 + 1


def not_div3(x: int) -> bool:
    return x % 3 != 0


def pair(x: int) -> list[int]:
    return [x, -x]


def tok(line: str) -> list[str]:
    return line.split()


def to_lengths(words: list[str]) -> tuple[int, ...]:
    return tuple(len(w) for w in words)


def tok_lengths(line: str) -> tuple[int, ...]:
    return to_lengths(tok(line))


def fail_on_7(x: int) -> int:
    """Raises for the input 7*2 (the first map doubles)."""
    if x == 14:
        raise ValueError(f"bad item {x}")
    return x


def annotate(x: Any) -> Any:
    return (x,)


def rng_draw(x: int, rng: Any) -> tuple[int, int]:
    import torch

    return x, int(torch.randint(0, 1 << 30, (1,), generator=rng))
