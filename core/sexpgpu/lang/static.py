"""Compile-time evaluation: values known before training (numbers, strings,
vectors, knobs, arithmetic and ``if``), and the typed readers built on it.

Every pass after ``settle`` reads values this way, through one :class:`Statics`
over the settled knobs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sexpgpu.errors import Pos
from sexpgpu.lang.ops.elementwise import STATIC_HEADS, static_apply
from sexpgpu.lang.reader import Atom, SList, SVec, Sym, show
from sexpgpu.lang.text import describe, err, suggest

__all__ = ["Pre", "Statics"]


@dataclass(frozen=True)
class Pre:
    """An argument that is already evaluated (the threaded value of ``->``)."""

    value: Any
    pos: Pos


class Statics:
    """Values known before training: those written, and the settled knobs'."""

    def __init__(self, knobs: Mapping[str, Any]) -> None:
        self.knobs = knobs

    def lookup_static(self, name: str, env: Mapping[str, Any]) -> tuple[bool, Any]:
        """``(found, value)`` of ``name`` in ``env``, then among the knobs."""
        if name in env:
            return True, env[name]
        if name in self.knobs:
            return True, self.knobs[name]
        return False, None

    def static(self, node: Any, env: Mapping[str, Any]) -> Any:
        """A compile-time value: numbers, strings, bools, vectors, knobs and arithmetic."""
        if isinstance(node, Pre):
            return node.value
        if isinstance(node, Atom):
            return node.value
        if isinstance(node, Sym):
            found, v = self.lookup_static(node.name, env)
            if not found:
                raise err(
                    f"unknown name '{node.name}'{suggest(node.name, [*env, *self.knobs])}",
                    node.pos,
                )
            return v
        if isinstance(node, SVec):
            return tuple(self.static(x, env) for x in node.items)
        if isinstance(node, SList) and node.items and isinstance(node.items[0], Sym):
            head = node.items[0].name
            if head in STATIC_HEADS or head == "if":
                if head == "if":
                    return self._static_if(node, env)
                vals = [self.static(x, env) for x in node.items[1:]]
                return static_apply(head, vals, node.pos)
        raise err(
            f"expected a value known before training (a number, knob or arithmetic), got {show(node)}",
            node.pos,
        )

    def _static_if(self, node: SList, env: Mapping[str, Any]) -> Any:
        if len(node.items) != 4:
            raise err("if takes a condition and two branches: (if c a b)", node.pos)
        c = self.static(node.items[1], env)
        if not isinstance(c, bool):
            raise err(f"if needs true or false, got {describe(c)}", node.items[1].pos)
        return self.static(node.items[2] if c else node.items[3], env)

    def word(self, node: Any, env: Mapping[str, Any], what: str) -> str:
        """A symbol written in place (``f32``, ``no-decay``), or a knob holding one."""
        if isinstance(node, Sym):
            found, v = self.lookup_static(node.name, env)
            if found and isinstance(v, str):
                return v
            return node.name
        if isinstance(node, Atom) and isinstance(node.value, str):
            return node.value
        raise err(f"expected {what}, got {show(node)}", node.pos)

    def words(self, node: Any, env: Mapping[str, Any], what: str) -> tuple[str, ...]:
        """A list of words, ``(a b)`` or ``[a b]``."""
        if isinstance(node, (SList, SVec)):
            return tuple(self.word(x, env, what) for x in node.items)
        raise err(f"expected a list of {what}, e.g. (a b), got {show(node)}", node.pos)

    def int_of(self, node: Any, env: Mapping[str, Any], what: str, low: int = 0) -> int:
        """``node``'s value as an integer of at least ``low``."""
        v = self.static(node, env)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise err(f"{what} must be an integer >= {low}, got {describe(v)}", node.pos)
        return v

    def num_of(self, node: Any, env: Mapping[str, Any], what: str) -> float:
        """``node``'s value as a number (a float)."""
        v = self.static(node, env)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise err(f"{what} must be a number, got {describe(v)}", node.pos)
        return float(v)

    def bool_of(self, node: Any, env: Mapping[str, Any], what: str) -> bool:
        """``node``'s value as true or false."""
        v = self.static(node, env)
        if not isinstance(v, bool):
            raise err(f"{what} must be true or false, got {describe(v)}", node.pos)
        return v
