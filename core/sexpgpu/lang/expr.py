"""The expression visitor: forward, loss and metric expressions compiled into graph
nodes. Every expression compiles through one :class:`ExprCompiler`: names,
``let``, ``->``, ``if``, calls of layers and stacks, and calls of ops (parsed
from their spec in the op registry, :mod:`sexpgpu.lang.ops`, or a plugin's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sexpgpu.errors import Pos, SourceError
from sexpgpu.lang import ir as g
from sexpgpu.lang.builder import Builder, Ctx, GraphEnv, T
from sexpgpu.lang.calls import OpCall, compile_call
from sexpgpu.lang.model import Instance, Stack, framed
from sexpgpu.lang.ops import BUILTINS
from sexpgpu.lang.reader import Atom, Kw, SList, SVec, Sym, show
from sexpgpu.lang.static import Pre, Statics
from sexpgpu.lang.text import describe, err, suggest

__all__ = ["SPECIAL_FORMS", "ExprCompiler"]

SPECIAL_FORMS = ("let", "->", "if")


class ExprCompiler:
    """Compiles expressions in a :class:`Ctx` into nodes of its graph; names not bound
    there are the knobs of ``statics``, and ``env`` holds what all graphs share."""

    def __init__(self, statics: Statics, env: GraphEnv) -> None:
        self.statics = statics
        self.env = env
        self._kinds: dict[type, Callable[[Any, Ctx], Any]] = {
            Pre: self._value,
            Atom: self._value,
            SVec: self._vector,
            Kw: self._keyword,
            Sym: self.name_value,
            SList: self._list,
        }
        self._special: dict[str, Callable[[list[Any], Pos, Ctx], Any]] = {
            "let": self.form_let,
            "->": self.form_thread,
            "if": self.form_if,
        }

    def expr(self, node: Any, ctx: Ctx) -> Any:
        """A forward, loss or metric expression: a tensor :class:`T` or a static value."""
        return self._kinds.get(type(node), self._list)(node, ctx)

    def _value(self, node: Pre | Atom, ctx: Ctx) -> Any:
        return node.value

    def _vector(self, node: SVec, ctx: Ctx) -> tuple[Any, ...]:
        return tuple(self.expr(x, ctx) for x in node.items)

    def _keyword(self, node: Kw, ctx: Ctx) -> Any:
        raise err(f"unexpected keyword :{node.name}", node.pos)

    def _list(self, node: SList, ctx: Ctx) -> Any:
        if not node.items:
            raise err("an empty list () is not an expression", node.pos)
        head = node.items[0]
        if not isinstance(head, Sym):
            raise err(f"expected an op or layer name, got {show(head)}", head.pos)
        return self.call(head, list(node.items[1:]), node.pos, ctx)

    def name_value(self, node: Sym, ctx: Ctx) -> Any:
        """What a name means in ``ctx``: a local, a parameter, a layer, a data field, a root or a knob."""
        name = node.name
        if name in ctx.locals:
            return ctx.locals[name]
        inst = ctx.inst
        if inst is not None:
            target = self._dotted(inst, name)
            if isinstance(target, g.ParamDecl):
                return ctx.b.param(target, node.pos)
            if target is not None:
                return target
            if name in inst.statics:
                return inst.statics[name]
        if ctx.fields is not None and name in ctx.fields:
            return ctx.b.input(name, ctx.fields[name], node.pos)
        if ctx.roots is not None and name in ctx.roots:
            return ctx.roots[name]
        if name in self.statics.knobs:
            return self.statics.knobs[name]
        candidates = [*ctx.locals, *self.statics.knobs]
        if inst is not None:
            candidates += [*inst.params, *inst.subs, *inst.statics]
        if ctx.fields is not None:
            candidates += list(ctx.fields)
        where = f" in {inst.ldef.name}" if inst is not None else ""
        raise err(f"unknown name '{name}'{where}{suggest(name, candidates)}", node.pos)

    def _dotted(self, inst: Instance, name: str) -> Any:
        parts = name.split(".")
        cur: Any = inst
        for i, part in enumerate(parts):
            if isinstance(cur, Instance):
                if part in cur.params and i == len(parts) - 1:
                    return cur.params[part]
                cur = cur.subs.get(part)
            elif isinstance(cur, Stack) and part.isdigit() and int(part) < cur.count:
                cur = cur.items[int(part)]
            else:
                return None
            if cur is None:
                return None
        return cur

    def call(self, head: Sym, args: list[Any], pos: Pos, ctx: Ctx) -> Any:
        """``(name args...)``: a special form, a call of a layer, or an op."""
        name = head.name
        special = self._special.get(name)
        if special is not None:
            return special(args, pos, ctx)
        # a sub-layer, a root or a local bound to a layer
        target = None
        if name in ctx.locals and isinstance(ctx.locals[name], (Instance, Stack)):
            target = ctx.locals[name]
        elif ctx.inst is not None:
            t = self._dotted(ctx.inst, name)
            if isinstance(t, (Instance, Stack)):
                target = t
        if target is None and ctx.roots is not None and name in ctx.roots:
            target = ctx.roots[name]
        if target is not None:
            return self.call_layer(target, [self.expr(a, ctx) for a in args], pos, ctx)
        builtin = self.env.ops.builtin(name, head.pos)
        if builtin is not None:
            spec, surface = builtin
            return compile_call(OpCall(self, spec, surface, args, pos, ctx))
        return self.plugin_call(head, args, pos, ctx)

    def plugin_call(self, head: Sym, args: list[Any], pos: Pos, ctx: Ctx) -> Any:
        """A call of a name that is no built-in op: a plugin's op, or an error."""
        name = head.name
        if ctx.inst is not None and name in ctx.inst.params:
            raise err(f"'{name}' is a parameter, not an op or layer", head.pos)
        if name in ("repeat", "param", "layer", "forward"):
            raise err(
                f"'{name}' is not an op; declare it in a deflayer: (layer blocks (repeat 2 (block dim)))"
                if name == "repeat"
                else f"'{name}' is not an op; it belongs directly in a deflayer or defmodel",
                head.pos,
            )
        spec = self.env.ops.find(name, head.pos)
        if spec is not None:
            return compile_call(OpCall(self, spec, name, args, pos, ctx))
        candidates = [*BUILTINS.surface_names(), *self.env.ops.names(), *SPECIAL_FORMS]
        if ctx.inst is not None:
            candidates += list(ctx.inst.subs)
        if ctx.roots is not None:
            candidates += list(ctx.roots)
        raise err(f"unknown op '{name}'{suggest(name, candidates)}{self.env.ops.hint()}", head.pos)

    def form_let(self, args: list[Any], pos: Pos, ctx: Ctx) -> Any:
        """``(let [a E1 b E2] body...)``: each binding sees the ones before it."""
        if len(args) < 2 or not isinstance(args[0], (SVec, SList)):
            raise err("let takes bindings and a body: (let [h (f x)] (g h))", pos)
        binds = list(args[0].items)
        pairs: list[tuple[Any, Any]] = []
        if binds and all(isinstance(b, SList) for b in binds):
            for b in binds:
                if len(b.items) != 2:
                    raise err("a let binding is (name value)", b.pos)
                pairs.append((b.items[0], b.items[1]))
        else:
            if len(binds) % 2:
                raise err("let bindings come in name value pairs", args[0].pos)
            pairs = [(binds[i], binds[i + 1]) for i in range(0, len(binds), 2)]
        local = dict(ctx.locals)
        inner = Ctx(ctx.b, ctx.inst, local, ctx.fields, ctx.roots)
        for name, value in pairs:
            if not isinstance(name, Sym):
                raise err(f"a let binding's name must be a symbol, got {show(name)}", name.pos)
            local[name.name] = self.expr(value, inner)
        result = None
        for body in args[1:]:
            result = self.expr(body, inner)
        return result

    def form_if(self, args: list[Any], pos: Pos, ctx: Ctx) -> Any:
        """``(if c a b)``: ``a`` or ``b``, by a condition known before training."""
        if len(args) != 3:
            raise err("if takes a condition and two branches: (if c a b)", pos)
        c = self.expr(args[0], ctx)
        if not isinstance(c, bool):
            raise err(
                f"if needs true or false known before training, got {describe(c)}", args[0].pos
            )
        return self.expr(args[1] if c else args[2], ctx)

    def form_thread(self, args: list[Any], pos: Pos, ctx: Ctx) -> Any:
        """``(-> x f (g 2))``: each step gets the value so far as its first argument."""
        if not args:
            raise err("-> takes a value and steps: (-> x f (g 2))", pos)
        value = self.expr(args[0], ctx)
        for step in args[1:]:
            if isinstance(step, Sym):
                value = self.call(step, [Pre(value, step.pos)], step.pos, ctx)
            elif isinstance(step, SList) and step.items and isinstance(step.items[0], Sym):
                value = self.call(
                    step.items[0], [Pre(value, step.pos), *step.items[1:]], step.pos, ctx
                )
            else:
                raise err(f"a -> step is a name or (name args...), got {show(step)}", step.pos)
        return value

    def call_layer(self, target: Instance | Stack, args: list[Any], pos: Pos, ctx: Ctx) -> T:
        """Call a layer (or stack) on ``args``; the same call in one graph is compiled once."""
        b = ctx.b
        key = (target.path, *(a.id if isinstance(a, T) else ("s", repr(a)) for a in args))
        if key in b.calls:
            return b.calls[key]
        if isinstance(target, Stack):
            result = self.call_stack(target, args, pos, ctx)
        else:
            ldef = target.ldef
            assert ldef.forward_args is not None
            if len(args) != len(ldef.forward_args):
                raise err(
                    f"{target.path} ({ldef.name}) takes {len(ldef.forward_args)} input"
                    f"{'s' if len(ldef.forward_args) != 1 else ''} ({' '.join(ldef.forward_args)}), got {len(args)}",
                    pos,
                )
            inner = Ctx(b, target, dict(zip(ldef.forward_args, args, strict=True)))
            result = None
            try:
                for body in ldef.forward_body:
                    result = self.expr(body, inner)
            except SourceError as exc:
                raise framed(exc, pos, target) from None
        b.calls[key] = result
        return result

    def call_stack(self, stack: Stack, args: list[Any], pos: Pos, ctx: Ctx) -> T:
        """A ``repeat``: its first layer's forward compiled once as the body of a ``repeat`` node."""
        if ctx.b.body is not None:
            raise err(f"{stack.path}: a repeat inside a repeated layer is not supported", pos)
        first = stack.items[0]
        fargs = first.ldef.forward_args or ()
        if len(args) != 1 or len(fargs) != 1:
            raise err(
                f"{stack.path}: a repeated layer takes one input (the carry), got {len(args)}", pos
            )
        carry = self.as_tensor(args[0], pos, ctx)
        body = Builder(self.env, (first.path, stack.path))
        c = body.input("carry", carry.type, pos)
        out = self.call_layer(first, [c], pos, Ctx(body, None, {}))
        if not isinstance(out, T) or out.type != carry.type:
            got = out.type if isinstance(out, T) else describe(out)
            raise err(
                f"repeat: {stack.path}'s layer {first.ldef.name} gives {got} but its input is {carry.type};"
                " a repeated layer must keep its input's shape",
                pos,
            )
        slots = tuple(tuple(f"{inst.path}.{rel}" for rel in body.slots) for inst in stack.items)
        graph = body.graph([out])
        attrs = {"count": stack.count, "body": graph, "slots": slots}
        return ctx.b.add("repeat", [carry], attrs, pos, type=carry.type, site=("stack", stack.path))

    def as_tensor(self, v: Any, pos: Pos, ctx: Ctx, like: str | None = None) -> T:
        """``v`` as a tensor: a number becomes a constant (an integer of dtype ``like`` if given)."""
        if isinstance(v, T):
            return v
        return ctx.b.const(v, pos, like)
