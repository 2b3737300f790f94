"""Small helpers for the compiler's error messages: suggestions and listings."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from sexpgpu.errors import Pos, SourceError

__all__ = ["describe", "err", "listing", "suggest"]


def suggest(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``candidates``, or nothing."""
    match = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def listing(names: Iterable[str], prefix: str = "") -> str:
    """``names`` sorted, comma-separated, each with ``prefix``; ``none`` when empty."""
    names = sorted(set(names))
    return ", ".join(prefix + n for n in names) if names else "none"


def err(message: str, pos: Pos | None) -> SourceError:
    """A positioned error in a `.sx` source."""
    return SourceError(message, pos=pos)


def describe(value: Any) -> str:
    """A compile-time value as an error message shows it.

    Values of the compiler's own kinds (tensors, layers) describe themselves
    through a ``shown`` property.
    """
    shown = getattr(value, "shown", None)
    if isinstance(shown, str):
        return shown
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + " ".join(describe(v) for v in value) + "]"
    if isinstance(value, str):
        return repr(value)
    return repr(value)
