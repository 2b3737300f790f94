"""What the compiler works with: definitions, layer instances, compile-time values,
the graph builder, and the parsing of ``:keyword value`` arguments."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sexpgpu import graph as g
from sexpgpu.errors import Pos, SourceError
from sexpgpu.lang.reader import Kw, SList, Sym, show
from sexpgpu.lang.text import describe, err, suggest

if TYPE_CHECKING:
    from sexpgpu.lang.compiler import Compiler

CORE_NAME = "<core>"
MAX_REPEAT = 4096  # a stack deeper than this is a typo, not a model


@dataclass
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


def relative_to_file(location: Any, pos: Pos) -> Any:
    """A file ``location`` written at ``pos``: a relative path is taken relative to
    the `.sx` file that writes it (as ``include`` is), so a run reads the same files
    from any working folder; a URI, an absolute path or ``~`` is kept as it is."""
    if not isinstance(location, str) or not location or pos.file == CORE_NAME:
        return location
    if "://" in location or location.startswith("~") or os.path.isabs(location):
        return location
    return os.path.normpath(os.path.join(os.path.dirname(pos.file), location))


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


@dataclass
class KnobDef:
    """A ``defknob``: its default, the kind of value it takes, and its value and source."""

    name: str
    default: Any
    kind: str  # int | float | bool | str | symbol
    doc: str
    pos: Pos
    value: Any = None
    source: str = "default"


@dataclass
class Instance:
    """A layer made with its constructor arguments at a path (``model.ff``)."""

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
class T:
    """A tensor value during compilation: a node id in the current graph and its type."""

    id: int
    type: g.TensorType

    @property
    def shown(self) -> str:
        """How an error message shows this value."""
        return f"a tensor {self.type}"


@dataclass(frozen=True)
class Pre:
    """An argument that is already evaluated (the threaded value of ``->``)."""

    value: Any
    pos: Pos


@dataclass
class Ctx:
    """Where an expression is compiled: the graph, the layer instance whose forward
    it is (``None`` for loss and metric expressions) and the names in scope."""

    b: Builder
    inst: Instance | None
    locals: dict[str, Any]
    fields: Mapping[str, g.TensorType] | None = None
    roots: Mapping[str, Instance] | None = None


class Builder:
    """Accumulates the nodes of one graph (or of one repeat body)."""

    def __init__(self, comp: Compiler, body: tuple[str, str] | None = None):
        self.comp = comp
        self.nodes: list[g.Node] = []
        self.params: dict[str, int] = {}
        self.inputs: dict[str, int] = {}
        self.calls: dict[tuple, Any] = {}
        # in a repeat body: (the first iteration's path, the stack's path)
        self.body = body
        self.slots: list[str] = []  # relative path of each slot

    def scope(self, path: str) -> str:
        """The choice-site scope of an instance path: iterations share the stack's."""
        if self.body is not None:
            first, stack = self.body
            if path == first or path.startswith(first + "."):
                return stack + path[len(first) :]
        return path

    def add(
        self,
        op: str,
        args: list[T],
        attrs: dict[str, Any],
        pos: Pos,
        *,
        type: g.TensorType | None = None,
        site: tuple[str, str] | None = None,
    ) -> T:
        """Add a node of ``op`` (typed by its rule unless ``type`` is given) and return it."""
        if type is None:
            type = self.comp.infer(op, [a.type for a in args], attrs, pos)
        site_name = None
        if site is not None:
            site_name = self.comp.site(site[0], site[1], pos, attrs)
        node = g.Node(
            len(self.nodes), op, tuple(a.id for a in args), dict(attrs), type, pos, site_name
        )
        self.nodes.append(node)
        return T(node.id, type)

    def param(self, decl: g.ParamDecl, pos: Pos) -> T:
        """The node reading parameter ``decl`` (a slot inside a repeat body); one per parameter."""
        if decl.path in self.params:
            i = self.params[decl.path]
            return T(i, self.nodes[i].type)
        if self.body is not None:
            first, _ = self.body
            if not decl.path.startswith(first + "."):
                raise err(
                    f"{decl.path} is outside the repeated layer and cannot be used in it", pos
                )
            self.slots.append(decl.path[len(first) + 1 :])
            attrs: dict[str, Any] = {"slot": len(self.slots) - 1}
        else:
            attrs = {"path": decl.path}
        t = self.add("param", [], attrs, pos, type=decl.type)
        self.params[decl.path] = t.id
        return t

    def input(self, name: str, type: g.TensorType, pos: Pos) -> T:
        """The node reading data field ``name``; one per field."""
        if name not in self.inputs:
            self.inputs[name] = self.add("input", [], {"name": name}, pos, type=type).id
        i = self.inputs[name]
        return T(i, self.nodes[i].type)

    def const(self, value: Any, pos: Pos, like: str | None = None) -> T:
        """A scalar constant node: ``i64`` for an integer when ``like`` is integral, else ``f32``."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise err(f"expected a tensor or a number, got {describe(value)}", pos)
        if isinstance(value, int) and like in ("i64", "bool"):
            return self.add("const", [], {"value": value}, pos, type=g.TensorType((), "i64"))
        return self.add("const", [], {"value": float(value)}, pos, type=g.TensorType((), "f32"))

    def graph(self, outputs: list[T]) -> g.Graph:
        """The graph of the nodes so far with ``outputs``."""
        return g.Graph(tuple(self.nodes), tuple(t.id for t in outputs))


def named_form(
    form: Any, head: str, usage: str, taken: set[str], allowed: tuple[str, ...]
) -> tuple[Sym, dict[str, Any]]:
    """``(head name :key value ...)``: its name (new among ``taken``, which it joins)
    and its keywords, each one of ``allowed``."""
    if not (
        isinstance(form, SList)
        and len(form.items) >= 2
        and isinstance(form.items[0], Sym)
        and form.items[0].name == head
        and isinstance(form.items[1], Sym)
    ):
        article = "an" if head[0] in "aeiou" else "a"
        what = "eval pass" if head == "eval" else head
        raise err(f"{article} {what} is {usage}, got {show(form)}", form.pos)
    name = form.items[1]
    if name.name in taken:
        what = "eval pass" if head == "eval" else head
        raise err(f"{what} '{name.name}' is listed twice", name.pos)
    taken.add(name.name)
    positional, keywords = split_args(form.items[2:])
    if positional:
        raise err(
            f"{head} takes :keyword value pairs, got {show(positional[0])}", positional[0].pos
        )
    return name, pick_keywords(keywords, allowed, head)


def split_args(items: Iterable[Any]) -> tuple[list[Any], list[tuple[Kw, Any]]]:
    """Positional arguments, then ``:keyword value`` pairs (keywords come last)."""
    positional: list[Any] = []
    keywords: list[tuple[Kw, Any]] = []
    items = list(items)
    i = 0
    while i < len(items):
        x = items[i]
        if isinstance(x, Kw):
            if i + 1 >= len(items) or isinstance(items[i + 1], Kw):
                raise err(f":{x.name} needs a value", x.pos)
            keywords.append((x, items[i + 1]))
            i += 2
            continue
        if keywords:
            raise err(f"positional {show(x)} after keyword arguments", x.pos)
        positional.append(x)
        i += 1
    return positional, keywords


def pick_keywords(
    pairs: list[tuple[Kw, Any]], allowed: tuple[str, ...], what: str
) -> dict[str, Any]:
    """The ``:keyword value`` pairs by name, each one of ``allowed`` and given once."""
    out: dict[str, Any] = {}
    for kw, v in pairs:
        if kw.name not in allowed:
            listed = ", ".join(":" + a for a in allowed) if allowed else "none"
            raise err(
                f"{what} has no option :{kw.name}{suggest(kw.name, allowed)}; its options: {listed}",
                kw.pos,
            )
        if kw.name in out:
            raise err(f":{kw.name} is given twice", kw.pos)
        out[kw.name] = v
    return out
