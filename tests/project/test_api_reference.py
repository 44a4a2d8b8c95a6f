"""``docs/api.md`` documents every public name: each class and function of
``centralpipe.__all__`` has its own section, each error a line under Errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import centralpipe as cp

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"
ERRORS = sorted(n for n in cp.__all__ if n.endswith("Error"))
NAMES = sorted(n for n in cp.__all__ if not n.endswith("Error"))


def _sections(text: str) -> dict[str, str]:
    """Each heading's first `name`, with the text under it up to the next heading."""
    out: dict[str, str] = {}
    parts = re.split(r"^(#+ .*)$", text, flags=re.M)
    for heading, body in zip(parts[1::2], parts[2::2]):
        found = re.search(r"`([A-Za-z_]+)`", heading)
        key = found.group(1) if found else heading.lstrip("# ").strip()
        out[key] = body
    return out


@pytest.mark.parametrize("name", NAMES)
def test_every_public_name_has_a_section(name: str) -> None:
    """A class or function of centralpipe's __all__ has a section of its own
    in docs/api.md (merge_states, gather_states and Total had none)."""
    sections = _sections(API.read_text(encoding="utf-8"))
    assert name in sections, f"docs/api.md has no section for `{name}`"
    assert sections[name].strip(), f"docs/api.md's section for `{name}` is empty"


def test_every_error_is_listed_under_errors() -> None:
    """Each public error class is named under the Errors heading."""
    errors = _sections(API.read_text(encoding="utf-8"))["Errors"]
    assert [n for n in ERRORS if f"`{n}`" not in errors] == []
