"""Building graphs: tensor values (:class:`T`), the place an expression is compiled
in (:class:`Ctx`), the node builder of one graph (:class:`Builder`), and what all
the graphs of a program share (:class:`GraphEnv`: its ops, choice sites and
dropout keys)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sexpgpu.errors import Pos
from sexpgpu.lang import ir as g
from sexpgpu.lang.model import Instance
from sexpgpu.lang.optable import OpTable
from sexpgpu.lang.text import describe, err

__all__ = ["Builder", "Ctx", "GraphEnv", "Sites", "T"]


@dataclass(frozen=True)
class T:
    """A tensor value during compilation: a node id in the current graph and its type."""

    id: int
    type: g.TensorType

    @property
    def shown(self) -> str:
        """How an error message shows this value."""
        return f"a tensor {self.type}"


@dataclass
class Ctx:
    """Where an expression is compiled: the graph, the layer instance whose forward
    it is (``None`` for loss and metric expressions) and the names in scope."""

    b: Builder
    inst: Instance | None
    locals: dict[str, Any]
    fields: Mapping[str, g.TensorType] | None = None
    roots: Mapping[str, Instance] | None = None


class Sites:
    """The choice sites and dropout keys of one program, shared by all its graphs:
    a place written once is one site (and one dropout key) wherever it is compiled."""

    def __init__(self) -> None:
        self._sites: dict[str, g.ChoiceSite] = {}
        self._keys: dict[tuple[str, str, Pos], str] = {}
        self._dropout: dict[tuple[str, Pos], int] = {}

    def site(self, kind: str, scope: str, pos: Pos, attrs: Mapping[str, Any]) -> str:
        """The name of the choice site of ``kind`` at ``scope`` written at ``pos`` (one per place)."""
        key = (kind, scope, pos)
        if key in self._keys:
            return self._keys[key]
        name = f"{kind}:{scope}"
        n = 2
        while name in self._sites:
            name, n = f"{kind}:{scope}#{n}", n + 1
        shown = {k: v for k, v in attrs.items() if k not in ("body", "slots", "site")}
        self._sites[name] = g.ChoiceSite(name, kind, pos, shown)
        self._keys[key] = name
        return name

    def named(self) -> tuple[g.ChoiceSite, ...]:
        """The sites named so far, in the order their nodes were added."""
        return tuple(self._sites.values())

    def dropout_key(self, scope: str, pos: Pos) -> int:
        """The key of the dropout written at ``pos`` in ``scope`` (iterations of a repeat share it)."""
        return self._dropout.setdefault((scope, pos), len(self._dropout))


@dataclass(frozen=True)
class GraphEnv:
    """What every graph of one program is built with: the ops it may call (typed by
    ``ops``) and the program's choice sites and dropout keys."""

    ops: OpTable
    sites: Sites = field(default_factory=Sites)


class Builder:
    """Accumulates the nodes of one graph (or of one repeat body)."""

    def __init__(self, env: GraphEnv, body: tuple[str, str] | None = None) -> None:
        self.env = env
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
            type = self.env.ops.infer(op, [a.type for a in args], attrs, pos)
        site_name = None
        if site is not None:
            site_name = self.env.sites.site(site[0], site[1], pos, attrs)
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
