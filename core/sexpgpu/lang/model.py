"""What the ``elaborate`` pass hands over: the layer instances of the run's roots
(``model``, and a ``:with-loaded`` second root) and every parameter they declare."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sexpgpu.errors import Pos, SourceError
from sexpgpu.lang import ir as g
from sexpgpu.lang.definitions import CORE_NAME, LayerDef
from sexpgpu.lang.text import describe

__all__ = ["MAX_REPEAT", "Instance", "Model", "Stack", "framed"]

MAX_REPEAT = 4096  # a stack deeper than this is a typo, not a model


@dataclass
class Instance:
    """A layer made with its constructor arguments at a path (``model.ff``).

    ``params`` and ``subs`` fill in as the layer is made; nothing changes them after.
    """

    path: str
    ldef: LayerDef
    statics: dict[str, Any]
    params: dict[str, g.ParamDecl] = field(default_factory=dict)
    subs: dict[str, Instance | Stack] = field(default_factory=dict)

    @property
    def shown(self) -> str:
        """How an error message shows this value."""
        return f"the layer {self.path}"

    @property
    def call(self) -> str:
        """The instance as a call-site frame shows it: ``model.ff (linear 128 64)``."""
        args = " ".join(describe(self.statics[p]) for p in self.ldef.params if p in self.statics)
        return f"{self.path} ({self.ldef.name}{' ' if args else ''}{args})"


@dataclass
class Stack:
    """``(repeat N layer)``: N identical instances at ``path.0`` ... ``path.N-1``."""

    path: str
    count: int
    items: list[Instance]
    pos: Pos

    @property
    def shown(self) -> str:
        """How an error message shows this value."""
        return f"the layer {self.path}"


@dataclass(frozen=True)
class Model:
    """The run's roots by name, and their parameters in the order declared."""

    roots: Mapping[str, Instance]
    params: tuple[g.ParamDecl, ...]


def framed(exc: SourceError, pos: Pos, inst: Instance) -> SourceError:
    """``exc``, raised inside ``inst``'s body, named from the call written at ``pos``.

    The error keeps one line, the caller's place first so an editor jumps to the
    user's file: ``my.sx:12:5: in model.ff (linear 128 64): <core>:8:19: matmul: ...``
    (docs/language.md, "Syntax"). A frame is added while the error points into the
    `<core>` prelude, which the user cannot edit: each call inside the prelude, up
    to the first call in a file of the user's, where it can be fixed.
    """
    if exc.pos is None or exc.pos.file != CORE_NAME:
        return exc
    message = exc.message
    if exc.code and message.startswith(exc.code):
        message = message[len(exc.code) :].lstrip(": ")
    return SourceError(f"in {inst.call}: {exc.pos}: {message}", code=exc.code, pos=pos)
