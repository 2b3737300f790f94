"""Option parsing shared by the commands that compile a `.sx` file."""

from __future__ import annotations

from sexpgpu.errors import UsageError


def parse_sets(values: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``("lr=0.25", "steps=6")`` -> ``{"lr": "0.25", "steps": "6"}``; the compiler types them."""
    sets: dict[str, str] = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"--set takes name=value, got '{item}'")
        sets[name.strip()] = value
    return sets
