"""The ``settle`` pass: each knob's value, default < variant < command line, and
where it came from."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sexpgpu.errors import Pos, UsageError
from sexpgpu.lang import ir as g
from sexpgpu.lang.definitions import Definitions, KnobDef
from sexpgpu.lang.reader import Atom, Sym, show
from sexpgpu.lang.text import err, listing, suggest

__all__ = ["Knobs", "settle_knobs"]

_KIND_TEXT = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "symbol": "a name",
}
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_SYMBOL = re.compile(r"[^\s()\[\]\";:][^\s()\[\]\";]*")


@dataclass(frozen=True)
class Knobs:
    """The settled knobs, in the order defined, as the program records them."""

    knobs: tuple[g.Knob, ...]
    values: Mapping[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", {k.name: k.value for k in self.knobs})


def settle_knobs(
    defs: Definitions, sets: Mapping[str, str], variant: str | None, steps: int | None
) -> Knobs:
    """Apply ``variant``, then the ``--set`` values ``sets``, then ``--steps``.

    Every variant is checked, chosen or not, so a typo shows up on the first check.
    """
    knobs = defs.knobs
    for v in defs.variants.values():
        for kw, node in v.settings:
            _value_of_node(_knob_for(knobs, kw.name, kw.pos), node)
    settled: dict[str, tuple[Any, str]] = {k.name: (k.default, "default") for k in knobs.values()}
    if variant is not None:
        if variant not in defs.variants:
            raise UsageError(
                f"unknown variant '{variant}'{suggest(variant, defs.variants)}; variants: {listing(defs.variants)}"
            )
        for kw, node in defs.variants[variant].settings:
            knob = _knob_for(knobs, kw.name, kw.pos)
            settled[knob.name] = (_value_of_node(knob, node), "variant")
    for key, text in sets.items():
        if key not in knobs:
            raise UsageError(
                f"--set {key}: unknown knob{suggest(key, knobs)}; knobs: {listing(knobs)}"
            )
        settled[key] = (_value_of_text(knobs[key], text), "command line")
    if steps is not None:
        if "steps" not in knobs:
            raise UsageError(
                "--steps sets the knob 'steps', and this file has none: add (defknob steps 100)"
                f" and use :steps steps; knobs: {listing(knobs)}"
            )
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise UsageError(f"--steps must be a positive integer, got {steps!r}")
        settled["steps"] = (_value_of_text(knobs["steps"], str(steps)), "command line")
    return Knobs(
        tuple(
            g.Knob(k.name, settled[k.name][0], k.default, settled[k.name][1], k.doc)
            for k in knobs.values()
        )
    )


def _knob_for(knobs: Mapping[str, KnobDef], name: str, pos: Pos) -> KnobDef:
    if name not in knobs:
        raise err(f"unknown knob '{name}'{suggest(name, knobs)}; knobs: {listing(knobs)}", pos)
    return knobs[name]


def _value_of_node(knob: KnobDef, node: Any) -> Any:
    """A variant's value for ``knob``, which must be of the knob's kind."""
    if isinstance(node, Sym) and knob.kind == "symbol":
        return node.name
    if isinstance(node, Atom):
        v = node.value
        if knob.kind == "float" and isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        if (
            (knob.kind == "int" and type(v) is int)
            or (knob.kind == "bool" and isinstance(v, bool))
            or (knob.kind == "str" and isinstance(v, str))
        ):
            return v
    raise err(f"knob '{knob.name}' takes {_KIND_TEXT[knob.kind]}, got {show(node)}", node.pos)


def _value_of_text(knob: KnobDef, text: str) -> Any:
    """A ``--set`` value, typed by the knob's default."""
    try:
        return _PARSERS[knob.kind](text)
    except ValueError:
        raise UsageError(
            f"--set {knob.name}={text}: knob '{knob.name}' takes {_KIND_TEXT[knob.kind]}"
            f" (its default is {_show_value(knob.default)})"
        ) from None


def _parse_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(text)
    return v


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(text)


def _parse_symbol(text: str) -> str:
    if not _SYMBOL.fullmatch(text):
        raise ValueError(text)
    return text


_PARSERS = {
    "int": lambda text: int(text.strip(), 10),
    "float": _parse_float,
    "bool": _parse_bool,
    "symbol": _parse_symbol,
    "str": lambda text: text,
}


def _show_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, str) else str(v)
