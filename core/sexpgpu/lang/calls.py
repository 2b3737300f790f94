"""Calls of ops: parsing a call's arguments from its :class:`OpSpec`.

:class:`OpCall` is the :class:`sexpgpu.lang.ops.Call` a per-op ``compile`` hook
sees; :func:`compile_call` is the parsing every op without a hook gets. Both
compile their arguments through the expression visitor
(:class:`sexpgpu.lang.expr.ExprCompiler`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sexpgpu.errors import Pos
from sexpgpu.lang.builder import Ctx, T
from sexpgpu.lang.model import Instance, Stack
from sexpgpu.lang.ops import REQUIRED, Keyword, OpSpec
from sexpgpu.lang.reader import Atom
from sexpgpu.lang.syntax import pick_keywords, split_args
from sexpgpu.lang.text import describe, err

if TYPE_CHECKING:
    from sexpgpu.lang.expr import ExprCompiler

__all__ = ["OpCall", "compile_call"]


class OpCall:
    """One call of an op in an expression (implements :class:`sexpgpu.lang.ops.Call`)."""

    def __init__(
        self,
        exprs: ExprCompiler,
        spec: OpSpec,
        name: str,
        arg_nodes: list[Any],
        pos: Pos,
        ctx: Ctx,
    ) -> None:
        self.exprs = exprs
        self.spec = spec
        self.name = name
        self.pos = pos
        self.ctx = ctx
        self.positional, self._pairs = split_args(arg_nodes)
        self.scope = ctx.b.scope(ctx.inst.path) if ctx.inst is not None else "loss"
        self._values: dict[int, Any] = {}

    def arity(self, lo: int, hi: int | None = None) -> None:
        """Refuse fewer than ``lo`` or more than ``hi`` positional arguments (99: no limit)."""
        hi = lo if hi is None else hi
        n = len(self.positional)
        if not lo <= n <= hi:
            want = f"{lo}" if lo == hi else (f"{lo} to {hi}" if hi < 99 else f"at least {lo}")
            raise err(
                f"{self.name} takes {want} argument{'s' if hi != 1 else ''}, got {n}", self.pos
            )

    def keywords(self, allowed: tuple[str, ...] = ()) -> dict[str, Any]:
        """The given keywords (name -> unevaluated node), each one of ``allowed``."""
        return pick_keywords(self._pairs, allowed, self.name)

    def value(self, i: int) -> Any:
        """Argument ``i`` compiled, once however often it is asked for."""
        if i not in self._values:
            self._values[i] = self.exprs.expr(self.positional[i], self.ctx)
        return self._values[i]

    def is_tensor(self, v: Any) -> bool:
        """Whether ``v`` is a tensor."""
        return isinstance(v, T)

    def tensor(self, i: int, like: str | None = None) -> T:
        """Argument ``i`` as a tensor (a number becomes a constant of dtype ``like``)."""
        return self.exprs.as_tensor(self.value(i), self.positional[i].pos, self.ctx, like)

    def constant(self, v: Any, pos: Pos, like: str | None = None) -> T:
        """``v`` (a tensor or a number) as a tensor."""
        return self.exprs.as_tensor(v, pos, self.ctx, like)

    def static(self, node: Any, what: str) -> Any:
        """``node``'s value, which must be known before training."""
        v = self.exprs.expr(node, self.ctx)
        if isinstance(v, (T, Instance, Stack)):
            raise err(f"{what} must be known before training, got {describe(v)}", node.pos)
        return v

    def static_int(self, node: Any, what: str, low: int | None = None) -> int:
        """``node``'s integer value (at least ``low``)."""
        v = self.static(node, what)
        if isinstance(v, bool) or not isinstance(v, int) or (low is not None and v < low):
            raise err(
                f"{what} must be an integer{'' if low is None else f' >= {low}'}, got {describe(v)}",
                node.pos,
            )
        return v

    def axis(self, node: Any, t: T, what: str = ":axis") -> int:
        """``node`` (or an integer written for it) as an axis of ``t``, counted from 0."""
        if isinstance(node, int):
            node = Atom(node, self.pos)
        a = self.static_int(node, what)
        nd = len(t.type.shape)
        if not -nd <= a < nd:
            raise err(f"{self.name}: {what} {a} is out of range for {t.type}", node.pos)
        return a % nd

    def word(self, node: Any, what: str) -> str:
        """A symbol written in place (``bf16``) or a name bound to one."""
        return self.exprs.statics.word(node, self.ctx.locals, what)

    def describe(self, v: Any) -> str:
        """``v`` as an error message shows it."""
        return describe(v)

    def add(self, op: str, args: list[Any], attrs: dict[str, Any]) -> T:
        """Add a node ``op`` at this call's place (a choice site if the spec has one)."""
        site = None
        if op == self.spec.name:
            if self.spec.site is not None:
                site = (self.spec.site, self.scope)
            if self.spec.plugin is not None:
                # the lowering finds a plugin op's implementation by the plugin that supplied it
                attrs = {**attrs, "plugin": self.spec.plugin}
        return self.ctx.b.add(op, args, attrs, self.pos, site=site)

    def dropout_key(self) -> int:
        """The key that tells this call's dropout masks apart from every other's."""
        return self.exprs.env.sites.dropout_key(self.scope, self.pos)

    def keyword_value(self, k: Keyword, node: Any, attrs: dict[str, Any]) -> Any:
        """The value of keyword ``k`` as given (``node``) or by default."""
        if node is None:
            return attrs[k.default_from] if k.default_from else _KINDS[k.kind][1](k.default)
        if k.kind == "int":
            return self.static_int(node, f":{k.name}", k.low)
        check, convert = _KINDS[k.kind]
        v = self.static(node, f":{k.name}")
        if not check(v):
            raise err(f":{k.name} must be {_KIND_TEXT[k.kind]}, got {describe(v)}", node.pos)
        return convert(v)


def _number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float))


_KINDS: dict[str, tuple[Callable[[Any], bool], Callable[[Any], Any]]] = {
    "int": (lambda v: True, lambda v: v),
    "number": (_number, float),
    "positive": (lambda v: _number(v) and v > 0, float),
    "bool": (lambda v: isinstance(v, bool), lambda v: v),
    "axis": (lambda v: True, lambda v: v),
}
_KIND_TEXT = {"number": "a number", "positive": "a positive number", "bool": "true or false"}


def compile_call(c: OpCall) -> Any:
    """Compile a call of ``c.spec``: its hook, or the parsing the spec describes.

    The order is the one users see errors in: the count of arguments, unknown
    keywords, missing ones, keyword values, then the tensors, then axes (which
    need the first tensor's shape).
    """
    spec = c.spec
    if spec.compile is not None:
        return spec.compile(c)
    lo, hi = spec.arity()
    c.arity(lo, hi)
    given = c.keywords(tuple(k.name for k in spec.keywords))
    for k in spec.keywords:
        if k.default is REQUIRED and k.default_from is None and k.name not in given:
            raise err(f"{c.name} needs :{k.name}, e.g. {k.example}", c.pos)
    attrs: dict[str, Any] = {}
    for k in spec.keywords:
        if k.kind != "axis":
            attrs[k.name] = c.keyword_value(k, given.get(k.name), attrs)
    if spec.fold is not None:
        values = [c.value(i) for i in range(len(c.positional))]
        if not any(c.is_tensor(v) for v in values):
            return spec.fold(values, c.pos)
    tensors: list[T] = []
    for i in range(len(c.positional)):
        arg = spec.args[min(i, len(spec.args) - 1)]
        like = arg.like
        if like is not None and like.startswith("@"):  # an earlier argument's dtype
            like = tensors[int(like[1:])].type.dtype
        tensors.append(c.tensor(i, like))
    for k in spec.keywords:
        if k.kind == "axis":
            attrs[k.name] = c.axis(given.get(k.name, k.default), tensors[0])
    return c.add(spec.name, tensors, {k.name: attrs[k.name] for k in spec.keywords})
