"""What the ``collect`` pass hands over: the sources read and the top-level
definitions they make, before any knob is settled or layer made."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sexpgpu.errors import Pos
from sexpgpu.lang import ir as g
from sexpgpu.lang.reader import Kw, SList

CORE_NAME = "<core>"
"""How the prelude that ships with the package is named in sources and errors."""


@dataclass(frozen=True)
class SourceText:
    """One source to read: its text and bytes, how errors name it (``file``), how the
    program records it (``name``), and its resolved path (``None`` for text in hand)."""

    text: str
    data: bytes
    file: str
    name: str
    path: str | None


@dataclass(frozen=True)
class LayerDef:
    """A ``deflayer`` or ``defmodel``: constructor parameters and body items."""

    name: str
    kind: str
    params: tuple[str, ...]
    items: tuple[SList, ...]
    forward_args: tuple[str, ...] | None
    forward_body: tuple[Any, ...]
    doc: str
    pos: Pos


@dataclass(frozen=True)
class KnobDef:
    """A ``defknob``: its default, and the kind of value it takes."""

    name: str
    default: Any
    kind: str  # int | float | bool | str | symbol
    doc: str
    pos: Pos


@dataclass(frozen=True)
class VariantDef:
    """A ``defvariant``: the ``:knob value`` settings it makes, as written."""

    name: str
    pos: Pos
    settings: tuple[tuple[Kw, Any], ...]


@dataclass(frozen=True)
class Definitions:
    """Everything the sources define, by kind, in the order written.

    The prelude's layers live apart from the user's (``core_layers``), so a user's
    ``linear`` never changes the prelude's ``mlp``. ``datas`` and ``run`` stay forms:
    they are read once the knobs are settled.
    """

    file: str
    sources: tuple[g.Source, ...]
    layers: Mapping[str, LayerDef]
    core_layers: Mapping[str, LayerDef]
    knobs: Mapping[str, KnobDef]
    variants: Mapping[str, VariantDef]
    datas: Mapping[str, SList]
    run: SList | None
