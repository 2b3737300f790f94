"""The compiler: `.sx` forms to a checked :class:`sexpgpu.graph.Program`.

It reads the `<core>` prelude and the main file (and what it includes), collects
the top-level definitions, settles the knobs (default < variant < command
line), instantiates the model into parameters, and compiles every loss and
eval expression into a graph whose every node has a shape and dtype. Errors
are :class:`SourceError` at the place the user wrote, or :class:`UsageError`
for command-line mistakes. Nothing here imports torch.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sexpgpu import graph as g
from sexpgpu.errors import PluginError, Pos, SexpError, SourceError, UsageError
from sexpgpu.lang import ops as O
from sexpgpu.lang.reader import Atom, Kw, SList, SVec, Sym, read, show

CORE_NAME = "<core>"
MAX_REPEAT = 4096  # a stack deeper than this is a typo, not a model
MAX_STATIC = 2**62  # compile-time integers stay well inside int64


def _suggest(name: str, candidates: Iterable[str]) -> str:
    match = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _listing(names: Iterable[str], prefix: str = "") -> str:
    names = sorted(set(names))
    return ", ".join(prefix + n for n in names) if names else "none"


def _err(message: str, pos: Pos | None) -> SourceError:
    return SourceError(message, pos=pos)


# ------------------------------------------------------------------ definitions


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


@dataclass
class KnobDef:
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


@dataclass
class Stack:
    """``(repeat N layer)``: N identical instances at ``path.0`` ... ``path.N-1``."""

    path: str
    count: int
    items: list[Instance]
    pos: Pos


@dataclass(frozen=True)
class T:
    """A tensor value during compilation: a node id in the current graph and its type."""

    id: int
    type: g.TensorType


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
        if type is None:
            type = O.infer(op, [a.type for a in args], attrs, pos)
        site_name = None
        if site is not None:
            site_name = self.comp.site(site[0], site[1], pos, attrs)
        node = g.Node(
            len(self.nodes), op, tuple(a.id for a in args), dict(attrs), type, pos, site_name
        )
        self.nodes.append(node)
        return T(node.id, type)

    def param(self, decl: g.ParamDecl, pos: Pos) -> T:
        if decl.path in self.params:
            i = self.params[decl.path]
            return T(i, self.nodes[i].type)
        if self.body is not None:
            first, _ = self.body
            if not decl.path.startswith(first + "."):
                raise _err(
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
        if name not in self.inputs:
            self.inputs[name] = self.add("input", [], {"name": name}, pos, type=type).id
        i = self.inputs[name]
        return T(i, self.nodes[i].type)

    def const(self, value: Any, pos: Pos, like: str | None = None) -> T:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _err(f"expected a tensor or a number, got {_describe(value)}", pos)
        if isinstance(value, int) and like in ("i64", "bool"):
            return self.add("const", [], {"value": value}, pos, type=g.TensorType((), "i64"))
        return self.add("const", [], {"value": float(value)}, pos, type=g.TensorType((), "f32"))

    def graph(self, outputs: list[T]) -> g.Graph:
        return g.Graph(tuple(self.nodes), tuple(t.id for t in outputs))


def _describe(value: Any) -> str:
    if isinstance(value, T):
        return f"a tensor {value.type}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + " ".join(_describe(v) for v in value) + "]"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (Instance, Stack)):
        return f"the layer {value.path}"
    return repr(value)


# ------------------------------------------------------------------ the op table

_BIN_SURFACE = {
    "+": "add",
    "-": "sub",
    "*": "mul",
    "/": "div",
    "add": "add",
    "sub": "sub",
    "mul": "mul",
    "div": "div",
    "pow": "pow",
    "maximum": "maximum",
    "minimum": "minimum",
}
_STATIC_BIN: dict[str, Callable[[Any, Any], Any]] = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: (
        a // b if isinstance(a, int) and isinstance(b, int) and a % b == 0 else a / b
    ),
    "pow": lambda a, b: a**b,
    "maximum": max,
    "minimum": min,
}
OP_NAMES = (
    *sorted(_BIN_SURFACE),
    *O.UNARY,
    "matmul",
    "reshape",
    "flatten",
    "transpose",
    "concat",
    "slice",
    "sum",
    "mean",
    "max",
    "min",
    "softmax",
    "log-softmax",
    "take",
    "layer-norm",
    "rms-norm",
    "attention",
    "conv2d",
    "max-pool2d",
    "avg-pool2d",
    "dropout",
    "cross-entropy",
    "mse",
    "accuracy",
    "cast",
    "shape",
    "size",
)
SPECIAL_FORMS = ("let", "->", "if")


# ------------------------------------------------------------------ the compiler


class Compiler:
    """One compilation: sources, definitions, knobs, and the program being built."""

    def __init__(self, main_file: str, base_dir: str):
        self.main_file = main_file
        self.base_dir = base_dir
        self.sources: list[g.Source] = []
        self.read_paths: set[str] = set()
        self.layers: dict[str, LayerDef] = {}
        self.core_layers: dict[str, LayerDef] = {}
        self.knobs: dict[str, KnobDef] = {}
        self.variants: dict[str, tuple[Pos, list[tuple[Kw, Any]]]] = {}
        self.datas: dict[str, SList] = {}
        self.data_decls: dict[str, g.DataDecl] = {}
        self.runs: list[SList] = []
        self.sites: dict[str, g.ChoiceSite] = {}
        self.site_keys: dict[tuple, str] = {}
        self.dropout_keys: dict[tuple, int] = {}
        self.params: list[g.ParamDecl] = []
        self.stage_losses: list[Any] = []
        self._plugins: Any = None

    # ---------------------------------------------------------------- reading

    def load(self, text: str, file: str, name: str, path: str | None, data: bytes) -> None:
        """Read one source and collect its top-level forms (includes recursively)."""
        self.sources.append(g.Source(name, path, hashlib.sha256(data).hexdigest()))
        for form in read(text, file):
            self.toplevel(form, file, name == CORE_NAME)

    def toplevel(self, form: Any, file: str, core: bool) -> None:
        if not isinstance(form, SList) or not form.items or not isinstance(form.items[0], Sym):
            raise _err(
                f"expected a top-level form such as (defrun ...), got {show(form)}", form.pos
            )
        head = form.items[0]
        handler = {
            "include": self.form_include,
            "defknob": self.form_defknob,
            "defvariant": self.form_defvariant,
            "deflayer": self.form_deflayer,
            "defmodel": self.form_deflayer,
            "defdata": self.form_defdata,
            "defrun": self.form_defrun,
        }.get(head.name)
        if handler is None:
            raise _err(
                f"unknown top-level form '{head.name}'"
                + _suggest(
                    head.name,
                    [
                        "include",
                        "defknob",
                        "defvariant",
                        "deflayer",
                        "defmodel",
                        "defdata",
                        "defrun",
                    ],
                ),
                head.pos,
            )
        handler(form, file, core)

    def form_include(self, form: SList, file: str, core: bool) -> None:
        if (
            len(form.items) != 2
            or not isinstance(form.items[1], Atom)
            or not isinstance(form.items[1].value, str)
        ):
            raise _err('include takes one file name: (include "lib.sx")', form.pos)
        rel = form.items[1].value
        here = os.path.dirname(file) if file != CORE_NAME else self.base_dir
        shown = os.path.normpath(os.path.join(here, rel))
        resolved = os.path.realpath(shown)
        if resolved in self.read_paths:
            return  # each file is read once; a cycle of includes ends here
        try:
            data = Path(resolved).read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise _err(f"cannot read '{rel}': {reason}", form.items[1].pos) from None
        self.read_paths.add(resolved)
        name = os.path.relpath(resolved, os.path.realpath(self.base_dir)).replace(os.sep, "/")
        self.load(text, shown, name, resolved, data)

    def _name(self, form: SList, index: int, what: str) -> Sym:
        if len(form.items) <= index or not isinstance(form.items[index], Sym):
            raise _err(f"{show(form.items[0])} needs a {what} name", form.pos)
        return form.items[index]

    def form_defknob(self, form: SList, file: str, core: bool) -> None:
        name = self._name(form, 1, "knob")
        if len(form.items) not in (3, 4):
            raise _err(
                'defknob takes a name, a default and an optional doc: (defknob lr 0.5 "learning rate")',
                form.pos,
            )
        default_node = form.items[2]
        if isinstance(default_node, Atom):
            v = default_node.value
            kind = "bool" if isinstance(v, bool) else type(v).__name__
        elif isinstance(default_node, Sym):
            v, kind = default_node.name, "symbol"
        else:
            raise _err(
                f"a knob's default must be a number, string, true/false or symbol, got {show(default_node)}",
                default_node.pos,
            )
        doc = ""
        if len(form.items) == 4:
            d = form.items[3]
            if not isinstance(d, Atom) or not isinstance(d.value, str):
                raise _err("a knob's doc must be a string", d.pos)
            doc = d.value
        if name.name in self.knobs:
            raise _err(
                f"knob '{name.name}' is already defined at {self.knobs[name.name].pos}", name.pos
            )
        self.knobs[name.name] = KnobDef(name.name, v, kind, doc, name.pos, v, "default")

    def form_defvariant(self, form: SList, file: str, core: bool) -> None:
        name = self._name(form, 1, "variant")
        rest = list(form.items[2:])
        if rest and isinstance(rest[0], Atom) and isinstance(rest[0].value, str):
            rest = rest[1:]  # a doc string
        settings: list[tuple[Kw, Any]] = []
        i = 0
        while i < len(rest):
            k = rest[i]
            if not isinstance(k, Kw):
                raise _err(f"a variant sets knobs as :name value pairs, got {show(k)}", k.pos)
            if i + 1 >= len(rest):
                raise _err(f":{k.name} needs a value", k.pos)
            if any(prev.name == k.name for prev, _ in settings):
                raise _err(f":{k.name} is set twice in variant {name.name}", k.pos)
            settings.append((k, rest[i + 1]))
            i += 2
        if name.name in self.variants:
            raise _err(
                f"variant '{name.name}' is already defined at {self.variants[name.name][0]}",
                name.pos,
            )
        self.variants[name.name] = (name.pos, settings)

    def form_deflayer(self, form: SList, file: str, core: bool) -> None:
        kind = form.items[0].name
        name = self._name(form, 1, "layer" if kind == "deflayer" else "model")
        if len(form.items) < 3 or not isinstance(form.items[2], SList):
            raise _err(
                f"{kind} {name.name} needs a parameter list, e.g. ({kind} {name.name} (dim) ...)",
                form.pos,
            )
        params = []
        for p in form.items[2].items:
            if not isinstance(p, Sym):
                raise _err(f"a {kind} parameter must be a name, got {show(p)}", p.pos)
            if p.name in params:
                raise _err(f"parameter '{p.name}' is listed twice", p.pos)
            params.append(p.name)
        items = list(form.items[3:])
        doc = ""
        if items and isinstance(items[0], Atom) and isinstance(items[0].value, str):
            doc = items.pop(0).value
        body: list[SList] = []
        fargs: tuple[str, ...] | None = None
        fbody: tuple[Any, ...] = ()
        names: dict[str, Pos] = {}
        for item in items:
            if not isinstance(item, SList) or not item.items or not isinstance(item.items[0], Sym):
                raise _err(
                    f"expected (param ...), (layer ...) or (forward ...) in {name.name}, got {show(item)}",
                    item.pos,
                )
            head = item.items[0].name
            if head == "forward":
                if fargs is not None:
                    raise _err(f"{name.name} has a second forward", item.pos)
                if len(item.items) < 3 or not isinstance(item.items[1], SList):
                    raise _err(
                        "forward takes an argument list and a body: (forward (x) ...)", item.pos
                    )
                args = []
                for a in item.items[1].items:
                    if not isinstance(a, Sym) or a.name in args:
                        raise _err(
                            f"a forward argument must be a distinct name, got {show(a)}", a.pos
                        )
                    args.append(a.name)
                fargs, fbody = tuple(args), tuple(item.items[2:])
            elif head in ("param", "layer"):
                if len(item.items) < 3 or not isinstance(item.items[1], Sym):
                    raise _err(
                        f"{head} needs a name and a {'shape' if head == 'param' else 'layer'}",
                        item.pos,
                    )
                n = item.items[1]
                if "." in n.name:
                    raise _err(f"a {head} name cannot contain '.': {n.name}", n.pos)
                if n.name in names:
                    raise _err(f"'{n.name}' is already declared at {names[n.name]}", n.pos)
                names[n.name] = n.pos
                body.append(item)
            else:
                raise _err(
                    f"unknown item '{head}' in {kind} {name.name}"
                    + _suggest(head, ["param", "layer", "forward"]),
                    item.items[0].pos,
                )
        if fargs is None:
            raise _err(f"{kind} {name.name} has no (forward (x) ...)", form.pos)
        ldef = LayerDef(name.name, kind, tuple(params), tuple(body), fargs, fbody, doc, name.pos)
        # the prelude's layers live apart, so a user's `linear` never changes `<core>`'s mlp
        table = self.core_layers if core else self.layers
        if name.name in table:
            raise _err(
                f"layer '{name.name}' is already defined at {table[name.name].pos}", name.pos
            )
        table[name.name] = ldef

    def form_defdata(self, form: SList, file: str, core: bool) -> None:
        name = self._name(form, 1, "data")
        if name.name in self.datas:
            raise _err(
                f"data '{name.name}' is already defined at {self.datas[name.name].items[1].pos}",
                name.pos,
            )
        if len(form.items) < 3:
            raise _err(
                "defdata needs a source: (defdata train (arithmetic :digits 3) :seq 32 :batch 16)",
                form.pos,
            )
        self.datas[name.name] = form

    def form_defrun(self, form: SList, file: str, core: bool) -> None:
        self._name(form, 1, "run")
        if self.runs:
            raise _err(f"a program has one defrun; the first is at {self.runs[0].pos}", form.pos)
        self.runs.append(form)

    # ---------------------------------------------------------------- knobs

    def settle_knobs(self, sets: Mapping[str, str], variant: str | None, steps: int | None) -> None:
        """Apply a variant, then ``--set`` values, then ``--steps``; record each knob's source."""
        # every variant is checked, chosen or not, so a typo shows up on the first check
        for _, settings in self.variants.values():
            for kw, node in settings:
                self._knob_value_from_node(self._knob_for(kw.name, kw.pos), node)
        if variant is not None:
            if variant not in self.variants:
                raise UsageError(
                    f"unknown variant '{variant}'{_suggest(variant, self.variants)}; variants: {_listing(self.variants)}"
                )
            for kw, node in self.variants[variant][1]:
                knob = self._knob_for(kw.name, kw.pos)
                knob.value = self._knob_value_from_node(knob, node)
                knob.source = "variant"
        for key, text in sets.items():
            if key not in self.knobs:
                raise UsageError(
                    f"--set {key}: unknown knob{_suggest(key, self.knobs)}; knobs: {_listing(self.knobs)}"
                )
            knob = self.knobs[key]
            knob.value = _parse_knob_text(knob, text)
            knob.source = "command line"
        if steps is not None:
            if "steps" not in self.knobs:
                raise UsageError(
                    "--steps sets the knob 'steps', and this file has none: add (defknob steps 100)"
                    f" and use :steps steps; knobs: {_listing(self.knobs)}"
                )
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
                raise UsageError(f"--steps must be a positive integer, got {steps!r}")
            knob = self.knobs["steps"]
            knob.value = _parse_knob_text(knob, str(steps))
            knob.source = "command line"

    def _knob_for(self, name: str, pos: Pos) -> KnobDef:
        if name not in self.knobs:
            raise _err(
                f"unknown knob '{name}'{_suggest(name, self.knobs)}; knobs: {_listing(self.knobs)}",
                pos,
            )
        return self.knobs[name]

    def _knob_value_from_node(self, knob: KnobDef, node: Any) -> Any:
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
        raise _err(f"knob '{knob.name}' takes {_kind_text(knob)}, got {show(node)}", node.pos)

    # ---------------------------------------------------------------- statics

    def lookup_static(self, name: str, env: Mapping[str, Any]) -> tuple[bool, Any]:
        if name in env:
            return True, env[name]
        if name in self.knobs:
            return True, self.knobs[name].value
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
                raise _err(
                    f"unknown name '{node.name}'{_suggest(node.name, [*env, *self.knobs])}",
                    node.pos,
                )
            return v
        if isinstance(node, SVec):
            return tuple(self.static(x, env) for x in node.items)
        if isinstance(node, SList) and node.items and isinstance(node.items[0], Sym):
            head = node.items[0].name
            if head in _BIN_SURFACE or head in ("max", "min", "neg", "abs", "if"):
                if head == "if":
                    return self._static_if(node, env)
                vals = [self.static(x, env) for x in node.items[1:]]
                return _static_apply(head, vals, node.pos)
        raise _err(
            f"expected a value known before training (a number, knob or arithmetic), got {show(node)}",
            node.pos,
        )

    def _static_if(self, node: SList, env: Mapping[str, Any]) -> Any:
        if len(node.items) != 4:
            raise _err("if takes a condition and two branches: (if c a b)", node.pos)
        c = self.static(node.items[1], env)
        if not isinstance(c, bool):
            raise _err(f"if needs true or false, got {_describe(c)}", node.items[1].pos)
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
        raise _err(f"expected {what}, got {show(node)}", node.pos)

    def words(self, node: Any, env: Mapping[str, Any], what: str) -> tuple[str, ...]:
        if isinstance(node, (SList, SVec)):
            return tuple(self.word(x, env, what) for x in node.items)
        raise _err(f"expected a list of {what}, e.g. (a b), got {show(node)}", node.pos)

    def int_of(self, node: Any, env: Mapping[str, Any], what: str, low: int = 0) -> int:
        v = self.static(node, env)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise _err(f"{what} must be an integer >= {low}, got {_describe(v)}", node.pos)
        return v

    def num_of(self, node: Any, env: Mapping[str, Any], what: str) -> float:
        v = self.static(node, env)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _err(f"{what} must be a number, got {_describe(v)}", node.pos)
        return float(v)

    def bool_of(self, node: Any, env: Mapping[str, Any], what: str) -> bool:
        v = self.static(node, env)
        if not isinstance(v, bool):
            raise _err(f"{what} must be true or false, got {_describe(v)}", node.pos)
        return v

    # ---------------------------------------------------------------- layers

    def instantiate(
        self,
        ctor: Any,
        path: str,
        env: Mapping[str, Any],
        active: tuple[tuple[str, Pos], ...],
        root: dict[str, Any],
    ) -> Instance | Stack:
        """Make the layer ``ctor`` names at ``path``, with its parameters declared."""
        if isinstance(ctor, Sym):
            ctor = SList((ctor,), ctor.pos)
        if not isinstance(ctor, SList) or not ctor.items or not isinstance(ctor.items[0], Sym):
            raise _err(f"expected a layer such as (mlp dim), got {show(ctor)}", ctor.pos)
        head = ctor.items[0]
        if head.name == "repeat":
            if len(ctor.items) != 3:
                raise _err("repeat takes a count and a layer: (repeat 4 (block dim))", ctor.pos)
            count = self.int_of(ctor.items[1], env, "repeat's count", 1)
            if count > MAX_REPEAT:
                raise _err(f"repeat's count {count} is more than {MAX_REPEAT}", ctor.items[1].pos)
            inner = ctor.items[2]
            if (
                isinstance(inner, SList)
                and inner.items
                and isinstance(inner.items[0], Sym)
                and inner.items[0].name == "repeat"
            ):
                raise _err(
                    "a repeat directly inside a repeat: use one (repeat (* a b) layer)", inner.pos
                )
            items = []
            for i in range(count):
                inst = self.instantiate(inner, f"{path}.{i}", env, active, root)
                assert isinstance(inst, Instance)
                items.append(inst)
            return Stack(path, count, items, ctor.pos)
        # a name in a prelude layer means the prelude's layer; elsewhere the user's comes first
        first, second = (
            (self.core_layers, self.layers)
            if head.pos.file == CORE_NAME
            else (self.layers, self.core_layers)
        )
        ldef = first.get(head.name) or second.get(head.name)
        if ldef is None:
            known = [*self.layers, *self.core_layers]
            raise _err(
                f"unknown layer '{head.name}'{_suggest(head.name, known)}; layers: {_listing(known)}",
                head.pos,
            )
        if (ldef.name, ldef.pos) in active:
            chain = " -> ".join([*(n for n, _ in active), ldef.name])
            raise _err(f"layer '{ldef.name}' contains itself ({chain})", head.pos)
        statics = self._bind_ctor(ldef, ctor, env)
        inst = Instance(path, ldef, statics)
        for item in ldef.items:
            kind, name = item.items[0].name, item.items[1].name
            if kind == "param":
                decl = self.param_decl(item, f"{path}.{name}", statics, root)
                inst.params[name] = decl
                self.params.append(decl)
            else:
                if len(item.items) != 3:
                    raise _err(
                        f"layer takes a name and one layer: (layer {name} (mlp dim))", item.pos
                    )
                inst.subs[name] = self.instantiate(
                    item.items[2], f"{path}.{name}", statics, (*active, (ldef.name, ldef.pos)), root
                )
        return inst

    def _bind_ctor(self, ldef: LayerDef, ctor: SList, env: Mapping[str, Any]) -> dict[str, Any]:
        positional, keywords = _split_args(ctor.items[1:])
        if len(positional) > len(ldef.params):
            raise _err(
                f"{ldef.name} takes {len(ldef.params)} argument{'s' if len(ldef.params) != 1 else ''}"
                f" ({' '.join(ldef.params) or 'none'}), got {len(positional)}",
                ctor.pos,
            )
        statics: dict[str, Any] = {}
        for pname, node in zip(ldef.params, positional, strict=False):
            statics[pname] = self.static(node, env)
        for kw, node in keywords:
            if kw.name not in ldef.params:
                raise _err(
                    f"{ldef.name} has no parameter :{kw.name}{_suggest(kw.name, ldef.params)}; its parameters: {_listing(ldef.params, ':')}",
                    kw.pos,
                )
            if kw.name in statics:
                raise _err(f":{kw.name} is given twice", kw.pos)
            statics[kw.name] = self.static(node, env)
        missing = [p for p in ldef.params if p not in statics]
        if missing:
            raise _err(
                f"{ldef.name} needs {' '.join(missing)} ({ldef.name} {' '.join(ldef.params)})",
                ctor.pos,
            )
        return statics

    def param_decl(
        self, item: SList, path: str, env: Mapping[str, Any], root: dict[str, Any]
    ) -> g.ParamDecl:
        name = item.items[1]
        positional, keywords = _split_args(item.items[2:])
        if len(positional) != 1:
            raise _err(
                f"param {name.name} takes one shape, e.g. (param {name.name} [dim dim] :init (normal 0.02))",
                item.pos,
            )
        shape_node = positional[0]
        if not isinstance(shape_node, SVec):
            raise _err(
                f"a shape is a vector such as [vocab dim], got {show(shape_node)}", shape_node.pos
            )
        shape = tuple(self.int_of(d, env, "a dimension", 1) for d in shape_node.items)
        opts = _keywords(keywords, ("init", "dtype", "frozen", "tags", "load"), "param")
        dtype = "f32"
        if "dtype" in opts:
            dtype = self.word(opts["dtype"], env, "a dtype")
            if dtype not in O.FLOATS:
                raise _err(f"a parameter's dtype is f32 or bf16, got {dtype}", opts["dtype"].pos)
        init = self.init_of(opts["init"], env) if "init" in opts else g.Init("normal", (0.02,))
        frozen = self.bool_of(opts["frozen"], env, ":frozen") if "frozen" in opts else False
        tags = self.words(opts["tags"], env, "tags") if "tags" in opts else ()
        load = self.load_of(opts["load"], env) if "load" in opts else None
        if root.get("loaded"):
            # a with-loaded root: every parameter is read from its file, frozen
            frozen = True
            if load is None:
                uri, template = root["loaded"]
                load = g.LoadSpec(
                    uri, template.replace("{path}", path).replace("{name}", path.split(".", 1)[1])
                )
        return g.ParamDecl(path, g.TensorType(shape, dtype), init, not frozen, tags, load, name.pos)

    def init_of(self, node: Any, env: Mapping[str, Any]) -> g.Init:
        spec = {
            "normal": (1, 1),
            "uniform": (2, 2),
            "zeros": (0, 0),
            "ones": (0, 0),
            "xavier": (0, 1),
            "kaiming": (0, 1),
        }
        if isinstance(node, Sym):
            head, args, pos = node.name, [], node.pos
        elif isinstance(node, SList) and node.items and isinstance(node.items[0], Sym):
            head, args, pos = node.items[0].name, list(node.items[1:]), node.pos
        else:
            raise _err(f"expected an initializer such as (normal 0.02), got {show(node)}", node.pos)
        if head not in spec:
            raise _err(
                f"unknown initializer '{head}'{_suggest(head, spec)}; initializers: {_listing(spec)}",
                pos,
            )
        lo, hi = spec[head]
        if not lo <= len(args) <= hi:
            want = {"normal": "(normal std)", "uniform": "(uniform low high)"}.get(
                head, f"({head} [gain])"
            )
            raise _err(
                f"{head} takes {lo}{'' if lo == hi else f' to {hi}'} argument{'s' if hi != 1 else ''}: {want}",
                pos,
            )
        values = tuple(self.num_of(a, env, f"{head}'s argument") for a in args)
        if head == "normal" and values[0] < 0:
            raise _err(f"normal's std must be >= 0, got {values[0]}", args[0].pos)
        if head == "uniform" and not values[0] < values[1]:
            raise _err(f"uniform needs low < high, got {values[0]} and {values[1]}", pos)
        if head in ("xavier", "kaiming") and not values:
            values = (1.0,)
        return g.Init(head, values)

    def load_of(self, node: Any, env: Mapping[str, Any]) -> g.LoadSpec:
        if not (
            isinstance(node, SList)
            and len(node.items) == 3
            and isinstance(node.items[0], Sym)
            and node.items[0].name == "file"
        ):
            raise _err(
                f':load takes (file "weights.safetensors" "tensor.name"), got {show(node)}',
                node.pos,
            )
        uri = self.static(node.items[1], env)
        tensor = self.static(node.items[2], env)
        if not isinstance(uri, str) or not isinstance(tensor, str) or not uri or not tensor:
            raise _err(
                "(file ...) takes two strings: the file and the tensor's name in it", node.pos
            )
        return g.LoadSpec(self.check_uri(uri, node.items[1].pos), tensor)

    def check_uri(self, uri: str, pos: Pos) -> str:
        scheme = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://", uri)
        if scheme and scheme.group(1) != "s3":
            raise _err(f"a :load file is a local path or s3://, got {scheme.group(1)}://", pos)
        if not (uri.endswith(".safetensors") or uri.endswith(".safetensors.index.json")):
            raise _err(
                f"a :load file is a .safetensors file or a .safetensors.index.json index, got '{uri}'",
                pos,
            )
        if scheme or os.path.isabs(uri):
            return uri
        # relative to the file that names it, as includes are
        return (
            os.path.normpath(os.path.join(os.path.dirname(pos.file), uri))
            if pos.file != CORE_NAME
            else uri
        )

    # ---------------------------------------------------------------- sites

    def site(self, kind: str, scope: str, pos: Pos, attrs: Mapping[str, Any]) -> str:
        key = (kind, scope, pos)
        if key in self.site_keys:
            return self.site_keys[key]
        name = f"{kind}:{scope}"
        n = 2
        while name in self.sites:
            name, n = f"{kind}:{scope}#{n}", n + 1
        shown = {k: v for k, v in attrs.items() if k not in ("body", "slots", "site")}
        self.sites[name] = g.ChoiceSite(name, kind, pos, shown)
        self.site_keys[key] = name
        return name

    def dropout_key(self, scope: str, pos: Pos) -> int:
        return self.dropout_keys.setdefault((scope, pos), len(self.dropout_keys))

    # ---------------------------------------------------------------- expressions

    def expr(self, node: Any, ctx: Ctx) -> Any:
        """A forward, loss or metric expression: a tensor :class:`T` or a static value."""
        if isinstance(node, Pre):
            return node.value
        if isinstance(node, Atom):
            return node.value
        if isinstance(node, SVec):
            return tuple(self.expr(x, ctx) for x in node.items)
        if isinstance(node, Kw):
            raise _err(f"unexpected keyword :{node.name}", node.pos)
        if isinstance(node, Sym):
            return self.name_value(node, ctx)
        if not node.items:
            raise _err("an empty list () is not an expression", node.pos)
        head = node.items[0]
        if not isinstance(head, Sym):
            raise _err(f"expected an op or layer name, got {show(head)}", head.pos)
        return self.call(head, list(node.items[1:]), node.pos, ctx)

    def name_value(self, node: Sym, ctx: Ctx) -> Any:
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
        if name in self.knobs:
            return self.knobs[name].value
        candidates = [*ctx.locals, *self.knobs]
        if inst is not None:
            candidates += [*inst.params, *inst.subs, *inst.statics]
        if ctx.fields is not None:
            candidates += list(ctx.fields)
        where = f" in {inst.ldef.name}" if inst is not None else ""
        raise _err(f"unknown name '{name}'{where}{_suggest(name, candidates)}", node.pos)

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
        name = head.name
        if name == "let":
            return self.form_let(args, pos, ctx)
        if name == "->":
            return self.form_thread(args, pos, ctx)
        if name == "if":
            if len(args) != 3:
                raise _err("if takes a condition and two branches: (if c a b)", pos)
            c = self.expr(args[0], ctx)
            if not isinstance(c, bool):
                raise _err(
                    f"if needs true or false known before training, got {_describe(c)}", args[0].pos
                )
            return self.expr(args[1] if c else args[2], ctx)
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
        surface = name if name in OP_NAMES else name.replace("_", "-")
        if surface not in OP_NAMES:
            if ctx.inst is not None and name in ctx.inst.params:
                raise _err(f"'{name}' is a parameter, not an op or layer", head.pos)
            candidates = [*OP_NAMES, *SPECIAL_FORMS]
            if ctx.inst is not None:
                candidates += list(ctx.inst.subs)
            if ctx.roots is not None:
                candidates += list(ctx.roots)
            if name in ("repeat", "param", "layer", "forward"):
                raise _err(
                    f"'{name}' is not an op; declare it in a deflayer: (layer blocks (repeat 2 (block dim)))"
                    if name == "repeat"
                    else f"'{name}' is not an op; it belongs directly in a deflayer or defmodel",
                    head.pos,
                )
            raise _err(f"unknown op '{name}'{_suggest(name, candidates)}", head.pos)
        return self.op(surface, args, pos, ctx)

    def form_let(self, args: list[Any], pos: Pos, ctx: Ctx) -> Any:
        if len(args) < 2 or not isinstance(args[0], (SVec, SList)):
            raise _err("let takes bindings and a body: (let [h (f x)] (g h))", pos)
        binds = list(args[0].items)
        pairs: list[tuple[Any, Any]] = []
        if binds and all(isinstance(b, SList) for b in binds):
            for b in binds:
                if len(b.items) != 2:
                    raise _err("a let binding is (name value)", b.pos)
                pairs.append((b.items[0], b.items[1]))
        else:
            if len(binds) % 2:
                raise _err("let bindings come in name value pairs", args[0].pos)
            pairs = [(binds[i], binds[i + 1]) for i in range(0, len(binds), 2)]
        local = dict(ctx.locals)
        inner = Ctx(ctx.b, ctx.inst, local, ctx.fields, ctx.roots)
        for name, value in pairs:
            if not isinstance(name, Sym):
                raise _err(f"a let binding's name must be a symbol, got {show(name)}", name.pos)
            local[name.name] = self.expr(value, inner)
        result = None
        for body in args[1:]:
            result = self.expr(body, inner)
        return result

    def form_thread(self, args: list[Any], pos: Pos, ctx: Ctx) -> Any:
        if not args:
            raise _err("-> takes a value and steps: (-> x f (g 2))", pos)
        value = self.expr(args[0], ctx)
        for step in args[1:]:
            if isinstance(step, Sym):
                value = self.call(step, [Pre(value, step.pos)], step.pos, ctx)
            elif isinstance(step, SList) and step.items and isinstance(step.items[0], Sym):
                value = self.call(
                    step.items[0], [Pre(value, step.pos), *step.items[1:]], step.pos, ctx
                )
            else:
                raise _err(f"a -> step is a name or (name args...), got {show(step)}", step.pos)
        return value

    def call_layer(self, target: Instance | Stack, args: list[Any], pos: Pos, ctx: Ctx) -> T:
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
                raise _err(
                    f"{target.path} ({ldef.name}) takes {len(ldef.forward_args)} input"
                    f"{'s' if len(ldef.forward_args) != 1 else ''} ({' '.join(ldef.forward_args)}), got {len(args)}",
                    pos,
                )
            inner = Ctx(b, target, dict(zip(ldef.forward_args, args, strict=True)))
            result = None
            for body in ldef.forward_body:
                result = self.expr(body, inner)
        b.calls[key] = result
        return result

    def call_stack(self, stack: Stack, args: list[Any], pos: Pos, ctx: Ctx) -> T:
        if ctx.b.body is not None:
            raise _err(f"{stack.path}: a repeat inside a repeated layer is not supported", pos)
        first = stack.items[0]
        fargs = first.ldef.forward_args or ()
        if len(args) != 1 or len(fargs) != 1:
            raise _err(
                f"{stack.path}: a repeated layer takes one input (the carry), got {len(args)}", pos
            )
        carry = self.as_tensor(args[0], pos, ctx)
        body = Builder(self, (first.path, stack.path))
        c = body.input("carry", carry.type, pos)
        out = self.call_layer(first, [c], pos, Ctx(body, None, {}))
        if not isinstance(out, T) or out.type != carry.type:
            got = out.type if isinstance(out, T) else _describe(out)
            raise _err(
                f"repeat: {stack.path}'s layer {first.ldef.name} gives {got} but its input is {carry.type};"
                " a repeated layer must keep its input's shape",
                pos,
            )
        slots = tuple(tuple(f"{inst.path}.{rel}" for rel in body.slots) for inst in stack.items)
        graph = body.graph([out])
        attrs = {"count": stack.count, "body": graph, "slots": slots}
        return ctx.b.add("repeat", [carry], attrs, pos, type=carry.type, site=("stack", stack.path))

    def as_tensor(self, v: Any, pos: Pos, ctx: Ctx, like: str | None = None) -> T:
        if isinstance(v, T):
            return v
        return ctx.b.const(v, pos, like)

    # ---------------------------------------------------------------- ops

    def op(self, name: str, arg_nodes: list[Any], pos: Pos, ctx: Ctx) -> Any:
        positional, keywords = _split_args(arg_nodes)
        b = ctx.b
        scope = b.scope(ctx.inst.path) if ctx.inst is not None else "loss"

        def kw(allowed: tuple[str, ...]) -> dict[str, Any]:
            return _keywords(keywords, allowed, name)

        def arity(lo: int, hi: int | None = None) -> None:
            hi = lo if hi is None else hi
            if not lo <= len(positional) <= hi:
                want = f"{lo}" if lo == hi else (f"{lo} to {hi}" if hi < 99 else f"at least {lo}")
                raise _err(
                    f"{name} takes {want} argument{'s' if hi != 1 else ''}, got {len(positional)}",
                    pos,
                )

        cache: dict[int, Any] = {}

        def value(i: int) -> Any:
            # each argument is compiled once, however often it is looked at
            if i not in cache:
                cache[i] = self.expr(positional[i], ctx)
            return cache[i]

        def tensor(i: int, like: str | None = None) -> T:
            return self.as_tensor(value(i), positional[i].pos, ctx, like)

        def st(node: Any, what: str) -> Any:
            v = self.expr(node, ctx)
            if isinstance(v, (T, Instance, Stack)):
                raise _err(f"{what} must be known before training, got {_describe(v)}", node.pos)
            return v

        def st_int(node: Any, what: str, low: int | None = None) -> int:
            v = st(node, what)
            if isinstance(v, bool) or not isinstance(v, int) or (low is not None and v < low):
                raise _err(
                    f"{what} must be an integer{'' if low is None else f' >= {low}'}, got {_describe(v)}",
                    node.pos,
                )
            return v

        def axis_of(node: Any, t: T, what: str = ":axis") -> int:
            a = st_int(node, what)
            nd = len(t.type.shape)
            if not -nd <= a < nd:
                raise _err(f"{name}: {what} {a} is out of range for {t.type}", node.pos)
            return a % nd

        if name in _BIN_SURFACE or (
            name in ("max", "min")
            and len(positional) >= 2
            and all(not isinstance(value(i), T) for i in range(len(positional)))
        ):
            irop = _BIN_SURFACE.get(name, {"max": "maximum", "min": "minimum"}.get(name))
            kw(())
            if name == "-" and len(positional) == 1:
                v = value(0)
                if not isinstance(v, T):
                    return _static_apply("neg", [v], pos)
                return b.add("neg", [v], {}, pos)
            arity(2, 99) if name in ("+", "*", "-", "max", "min") else arity(2)
            vals = [value(i) for i in range(len(positional))]
            acc = vals[0]
            for i, v in enumerate(vals[1:], start=1):
                if not isinstance(acc, T) and not isinstance(v, T):
                    acc = _static_apply(name, [acc, v], pos)
                    continue
                like = acc.type.dtype if isinstance(acc, T) else v.type.dtype
                left = self.as_tensor(acc, positional[0].pos, ctx, like)
                right = self.as_tensor(v, positional[i].pos, ctx, like)
                acc = b.add(irop, [left, right], {}, pos)
            return acc
        if name in O.UNARY:
            arity(1)
            kw(())
            v = value(0)
            if not isinstance(v, T) and name in ("neg", "abs"):
                return _static_apply(name, [v], pos)
            return b.add(name, [self.as_tensor(v, positional[0].pos, ctx)], {}, pos)
        if name == "matmul":
            arity(2)
            kw(())
            return b.add("matmul", [tensor(0), tensor(1)], {}, pos)
        if name == "reshape":
            arity(2)
            kw(())
            x = tensor(0)
            dims = st(positional[1], "reshape's shape")
            if not isinstance(dims, tuple) or any(
                isinstance(d, bool) or not isinstance(d, int) for d in dims
            ):
                raise _err(
                    f"reshape's shape is a vector of integers such as [b -1], got {_describe(dims)}",
                    positional[1].pos,
                )
            return b.add(
                "reshape", [x], {"shape": _resolve_shape(dims, x.type, positional[1].pos)}, pos
            )
        if name == "flatten":
            arity(1)
            opts = kw(("from",))
            x = tensor(0)
            start = (
                axis_of(opts["from"], x, ":from") if "from" in opts else min(1, len(x.type.shape))
            )
            shape = (*x.type.shape[:start], math.prod(x.type.shape[start:]))
            return b.add("reshape", [x], {"shape": shape}, pos)
        if name == "transpose":
            arity(1, 3)
            kw(())
            x = tensor(0)
            if len(positional) == 2:
                raise _err(
                    "transpose takes a tensor and two axes, or just a tensor (the last two axes)",
                    pos,
                )
            if len(x.type.shape) < 2:
                raise _err(f"transpose: needs at least two axes, got {x.type}", pos)
            if len(positional) == 3:
                axes = (axis_of(positional[1], x, "an axis"), axis_of(positional[2], x, "an axis"))
            else:
                nd = len(x.type.shape)
                axes = (nd - 2, nd - 1)
            return b.add("transpose", [x], {"axes": axes}, pos)
        if name == "concat":
            arity(1, 99)
            opts = kw(("axis",))
            xs = [tensor(i) for i in range(len(positional))]
            axis = axis_of(opts["axis"], xs[0]) if "axis" in opts else axis_of(Atom(-1, pos), xs[0])
            return b.add("concat", xs, {"axis": axis}, pos)
        if name == "slice":
            arity(1)
            opts = kw(("axis", "start", "stop"))
            x = tensor(0)
            axis = axis_of(opts["axis"], x) if "axis" in opts else axis_of(Atom(-1, pos), x)
            size = x.type.shape[axis]
            start = st_int(opts["start"], ":start") if "start" in opts else 0
            stop = st_int(opts["stop"], ":stop") if "stop" in opts else size
            start, stop = (
                (start + size if start < 0 else start),
                (stop + size if stop < 0 else stop),
            )
            return b.add("slice", [x], {"axis": axis, "start": start, "stop": stop}, pos)
        if name in ("sum", "mean", "max", "min"):
            if name == "min":
                raise _err(
                    "min of a tensor is (neg (max (neg x))); (min a b) works on numbers and minimum on tensors",
                    pos,
                )
            arity(1)
            opts = kw(("axis", "axes", "keepdim"))
            x = tensor(0)
            if "axis" in opts and "axes" in opts:
                raise _err(f"{name} takes :axis or :axes, not both", pos)
            if "axis" in opts:
                axes: tuple[int, ...] = (axis_of(opts["axis"], x),)
            elif "axes" in opts:
                raw = st(opts["axes"], ":axes")
                if not isinstance(raw, tuple):
                    raise _err(
                        f":axes is a vector such as [0 1], got {_describe(raw)}", opts["axes"].pos
                    )
                axes = tuple(
                    sorted(
                        {
                            axis_of(Atom(a, opts["axes"].pos), x, "an axis")
                            if isinstance(a, int) and not isinstance(a, bool)
                            else st_int(Atom(a, opts["axes"].pos), "an axis")
                            for a in raw
                        }
                    )
                )
            else:
                axes = tuple(range(len(x.type.shape)))
            keep = False
            if "keepdim" in opts:
                keep = st(opts["keepdim"], ":keepdim")
                if not isinstance(keep, bool):
                    raise _err(
                        f":keepdim must be true or false, got {_describe(keep)}",
                        opts["keepdim"].pos,
                    )
            return b.add(name, [x], {"axes": axes, "keepdim": keep}, pos)
        if name in ("softmax", "log-softmax"):
            arity(1)
            opts = kw(("axis",))
            x = tensor(0)
            if not x.type.shape:
                raise _err(f"{name}: needs at least one axis, got {x.type}", pos)
            axis = axis_of(opts["axis"], x) if "axis" in opts else len(x.type.shape) - 1
            return b.add(name.replace("-", "_"), [x], {"axis": axis}, pos)
        if name == "take":
            arity(2)
            kw(())
            return b.add("take", [tensor(0), tensor(1, "i64")], {}, pos)
        if name in ("layer-norm", "rms-norm"):
            n = 3 if name == "layer-norm" else 2
            arity(n)
            opts = kw(("eps",))
            eps = 1e-5 if name == "layer-norm" else 1e-6
            if "eps" in opts:
                eps = st(opts["eps"], ":eps")
                if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
                    raise _err(
                        f":eps must be a positive number, got {_describe(eps)}", opts["eps"].pos
                    )
            return b.add(
                name.replace("-", "_"), [tensor(i) for i in range(n)], {"eps": float(eps)}, pos
            )
        if name == "attention":
            arity(3)
            opts = kw(("heads", "causal"))
            if "heads" not in opts:
                raise _err("attention needs :heads, e.g. (attention q k v :heads 4)", pos)
            heads = st_int(opts["heads"], ":heads", 1)
            causal = True
            if "causal" in opts:
                causal = st(opts["causal"], ":causal")
                if not isinstance(causal, bool):
                    raise _err(
                        f":causal must be true or false, got {_describe(causal)}",
                        opts["causal"].pos,
                    )
            qkv = [tensor(i) for i in range(3)]
            return b.add(
                "attention", qkv, {"heads": heads, "causal": causal}, pos, site=("attention", scope)
            )
        if name == "conv2d":
            arity(2, 3)
            opts = kw(("stride", "padding"))
            stride = st_int(opts["stride"], ":stride", 1) if "stride" in opts else 1
            padding = st_int(opts["padding"], ":padding", 0) if "padding" in opts else 0
            xs = [tensor(i) for i in range(len(positional))]
            return b.add(
                "conv2d", xs, {"stride": stride, "padding": padding}, pos, site=("conv2d", scope)
            )
        if name in ("max-pool2d", "avg-pool2d"):
            arity(1)
            opts = kw(("kernel", "stride"))
            if "kernel" not in opts:
                raise _err(f"{name} needs :kernel, e.g. ({name} x :kernel 2)", pos)
            kernel = st_int(opts["kernel"], ":kernel", 1)
            stride = st_int(opts["stride"], ":stride", 1) if "stride" in opts else kernel
            return b.add(
                name.replace("-", "_"), [tensor(0)], {"kernel": kernel, "stride": stride}, pos
            )
        if name == "dropout":
            arity(1, 2)
            opts = kw(("p",))
            if len(positional) == 2 and "p" in opts:
                raise _err("dropout: give p once", pos)
            pnode = positional[1] if len(positional) == 2 else opts.get("p")
            if pnode is None:
                raise _err("dropout needs p: (dropout x 0.1)", pos)
            p = st(pnode, "dropout's p")
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
                raise _err(f"dropout's p must be in [0, 1), got {_describe(p)}", pnode.pos)
            return b.add(
                "dropout", [tensor(0)], {"p": float(p), "key": self.dropout_key(scope, pos)}, pos
            )
        if name in ("cross-entropy", "accuracy", "mse"):
            arity(2)
            kw(())
            x = tensor(0)
            y = tensor(1, "i64" if name != "mse" else x.type.dtype)
            return b.add(name.replace("-", "_"), [x, y], {}, pos)
        if name == "cast":
            arity(2)
            kw(())
            x = tensor(0)
            dtype = self.word(positional[1], ctx.locals, "a dtype")
            if dtype not in g.DTYPES:
                raise _err(
                    f"unknown dtype '{dtype}'{_suggest(dtype, g.DTYPES)}; dtypes: {_listing(g.DTYPES)}",
                    positional[1].pos,
                )
            return b.add("cast", [x], {"dtype": dtype}, pos)
        if name == "shape":
            arity(1)
            kw(())
            return tensor(0).type.shape
        if name == "size":
            arity(2)
            kw(())
            x = tensor(0)
            return x.type.shape[axis_of(positional[1], x, "an axis")]
        raise _err(f"unknown op '{name}'", pos)  # pragma: no cover - OP_NAMES and this agree

    # ---------------------------------------------------------------- data, optimizer

    def plugins(self) -> Any:
        if self._plugins is None:
            from sexpgpu.plugins import get_plugins

            self._plugins = get_plugins()
        return self._plugins

    def _descriptor(self, hook: str, what: str, name: str, pos: Pos) -> Any:
        plugins = self.plugins()
        known = sorted({item.name for item, _ in plugins.supplied(hook)})
        if name not in known:
            raise _err(
                f"unknown {what} '{name}'{_suggest(name, known)}; {what}s: {_listing(known)}", pos
            )
        try:
            return plugins.require(hook, f"the {what} '{name}'", lambda i: i.name == name)
        except PluginError as exc:
            raise _err(exc.message, pos) from None

    def data_decl(self, name_node: Any) -> g.DataDecl:
        if not isinstance(name_node, Sym):
            raise _err(f":data names a defdata, got {show(name_node)}", name_node.pos)
        name = name_node.name
        if name not in self.datas:
            raise _err(
                f"unknown data '{name}'{_suggest(name, self.datas)}; defdata: {_listing(self.datas)}",
                name_node.pos,
            )
        if name in self.data_decls:
            return self.data_decls[name]
        form = self.datas[name]
        src = form.items[2]
        if isinstance(src, Sym):
            src = SList((src,), src.pos)
        if not isinstance(src, SList) or not src.items or not isinstance(src.items[0], Sym):
            raise _err(f"a data source is (name :option value ...), got {show(src)}", src.pos)
        sname = src.items[0]
        info = self._descriptor("sexpgpu_data_sources", "data source", sname.name, sname.pos)
        positional, keywords = _split_args(src.items[1:])
        if positional:
            raise _err(
                f"data source options are :name value pairs, got {show(positional[0])}",
                positional[0].pos,
            )
        options = dict(info.options)
        for kw, node in keywords:
            key = kw.name.replace("-", "_")
            if key not in info.options:
                valid = [":" + k.replace("_", "-") for k in info.options]
                raise _err(
                    f"data source '{sname.name}' has no option :{kw.name}{_suggest(':' + kw.name, valid)};"
                    f" its options: {', '.join(sorted(valid)) or 'none'}",
                    kw.pos,
                )
            options[key] = self.option_value(node, info.options[key], kw.name, {})
        _, run_kw = _split_args(form.items[3:])
        p3, _ = _split_args(form.items[3:])
        if p3:
            raise _err(
                f"defdata takes :seq and :batch after the source, got {show(p3[0])}", p3[0].pos
            )
        opts = _keywords(run_kw, ("seq", "batch"), "defdata")
        if "batch" not in opts:
            raise _err(f"defdata {name} needs :batch", form.pos)
        seq = self.int_of(opts["seq"], {}, ":seq", 1) if "seq" in opts else 0
        batch = self.int_of(opts["batch"], {}, ":batch", 1)
        try:
            fields = dict(info.fields(options, seq, batch))
        except SexpError as exc:
            # keep the source's stable code (E-DATA-00x): the line names it for docs/errors.md
            raise SourceError(exc.message, code=exc.code, pos=exc.pos or src.pos) from None
        except Exception as exc:  # a data source's own complaint about its options
            raise _err(f"data source '{sname.name}': {exc}", src.pos) from None
        decl = g.DataDecl(name, sname.name, options, seq, batch, fields, form.items[1].pos)
        self.data_decls[name] = decl
        return decl

    def option_value(self, node: Any, default: Any, what: str, env: Mapping[str, Any]) -> Any:
        """An option's value, checked against the kind of its default."""
        if isinstance(default, (tuple, list)):
            return self.words(node, env, "names")
        v = self.static(node, env)
        if isinstance(default, bool):
            if not isinstance(v, bool):
                raise _err(f":{what} must be true or false, got {_describe(v)}", node.pos)
        elif isinstance(default, float):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise _err(f":{what} must be a number, got {_describe(v)}", node.pos)
            v = float(v)
        elif isinstance(default, int):
            if isinstance(v, bool) or not isinstance(v, int):
                raise _err(f":{what} must be an integer, got {_describe(v)}", node.pos)
        elif isinstance(default, str) and not isinstance(v, str):
            raise _err(f":{what} must be a string, got {_describe(v)}", node.pos)
        return v

    def optimizer_decl(self, node: Any, base: g.OptimizerDecl | None) -> g.OptimizerDecl:
        if isinstance(node, Sym):
            node = SList((node,), node.pos)
        if not isinstance(node, SList) or not node.items or not isinstance(node.items[0], Sym):
            raise _err(
                f"an optimizer is (name :option value ...), e.g. (adam :lr 0.001), got {show(node)}",
                node.pos,
            )
        name = node.items[0]
        info = self._descriptor("sexpgpu_optimizers", "optimizer", name.name, name.pos)
        positional, keywords = _split_args(node.items[1:])
        if positional:
            raise _err(
                f"optimizer options are :name value pairs, got {show(positional[0])}",
                positional[0].pos,
            )
        # a stage that names the same optimizer starts from the run's settings
        same = base is not None and base.name == name.name
        options = dict(base.options) if same else dict(info.options)
        schedule = base.schedule if same else g.Schedule()
        clip = base.clip if same else None
        seen: set[str] = set()
        for kw, v in keywords:
            if kw.name in seen:
                raise _err(f":{kw.name} is given twice", kw.pos)
            seen.add(kw.name)
            if kw.name == "schedule":
                schedule = self.schedule_of(v)
                continue
            if kw.name == "clip":
                c = self.static(v, {})
                if isinstance(c, bool) and not c:
                    clip = None
                elif isinstance(c, bool) or not isinstance(c, (int, float)) or c <= 0:
                    raise _err(
                        f":clip is a positive global norm (or false), got {_describe(c)}", v.pos
                    )
                else:
                    clip = float(c)
                continue
            key = kw.name.replace("-", "_")
            if key not in info.options:
                valid = [":" + k.replace("_", "-") for k in info.options] + [":schedule", ":clip"]
                raise _err(
                    f"optimizer '{name.name}' has no option :{kw.name}{_suggest(':' + kw.name, valid)};"
                    f" its options: {', '.join(sorted(valid))}",
                    kw.pos,
                )
            options[key] = self.option_value(v, info.options[key], kw.name, {})
        if options.get("lr") is None and "lr" in info.options:
            raise _err(f"optimizer '{name.name}' needs :lr", node.pos)
        return g.OptimizerDecl(name.name, options, schedule, clip, node.pos)

    def schedule_of(self, node: Any) -> g.Schedule:
        if isinstance(node, Sym):
            node = SList((node,), node.pos)
        if not isinstance(node, SList) or not node.items or not isinstance(node.items[0], Sym):
            raise _err(
                f"a schedule is constant, (warmup :warmup 10) or (cosine :warmup 10 :min-lr 0.0), got {show(node)}",
                node.pos,
            )
        kind = node.items[0]
        kinds = ("constant", "warmup", "cosine")
        if kind.name not in kinds:
            raise _err(
                f"unknown schedule '{kind.name}'{_suggest(kind.name, kinds)}; schedules: {_listing(kinds)}",
                kind.pos,
            )
        positional, keywords = _split_args(node.items[1:])
        if positional:
            raise _err(
                f"schedule options are :name value pairs, got {show(positional[0])}",
                positional[0].pos,
            )
        allowed = {"constant": (), "warmup": ("warmup",), "cosine": ("warmup", "min-lr")}[kind.name]
        opts = _keywords(keywords, allowed, kind.name)
        warmup = self.int_of(opts["warmup"], {}, ":warmup", 0) if "warmup" in opts else 0
        if kind.name == "warmup" and "warmup" not in opts:
            raise _err("(warmup :warmup N) needs its number of steps", node.pos)
        min_lr = self.num_of(opts["min-lr"], {}, ":min-lr") if "min-lr" in opts else 0.0
        return g.Schedule(kind.name, warmup, min_lr)

    # ---------------------------------------------------------------- the run

    def build(self, file: str, variant: str | None) -> g.Program:
        if not self.runs:
            raise _err("no (defrun ...) in this program", Pos(file, 1, 1))
        form = self.runs[0]
        run_name = form.items[1].name
        positional, keywords = _split_args(form.items[2:])
        if positional:
            raise _err(
                f"defrun takes :keyword value pairs, got {show(positional[0])}", positional[0].pos
            )
        allowed = (
            "model",
            "data",
            "loss",
            "optimizer",
            "steps",
            "checkpoint-every",
            "seed",
            "precision",
            "counters",
            "guard-finite",
            "deterministic",
            "stages",
            "evals",
            "with-loaded",
        )
        opts = _keywords(keywords, allowed, "defrun")
        env: dict[str, Any] = {}
        if "model" not in opts:
            raise _err("defrun needs :model, e.g. :model (net 32 8)", form.pos)
        roots: dict[str, Instance] = {}
        model = self.instantiate(opts["model"], "model", env, (), {})
        if not isinstance(model, Instance):
            raise _err(":model is a layer such as (net 32 8), not a repeat", opts["model"].pos)
        roots["model"] = model
        if "with-loaded" in opts:
            name, inst = self.with_loaded(opts["with-loaded"], roots)
            roots[name] = inst

        seed = self.int_of(opts["seed"], env, ":seed", 0) if "seed" in opts else 0
        precision = "f32"
        if "precision" in opts:
            precision = self.word(opts["precision"], env, "a precision")
            if precision not in O.FLOATS:
                raise _err(f":precision is f32 or bf16, got {precision}", opts["precision"].pos)
        counters: tuple[str, ...] = ()
        if "counters" in opts:
            counters = self.words(opts["counters"], env, "counters")
            for c, n in zip(counters, opts["counters"].items, strict=True):
                if c not in ("tokens", "records"):
                    raise _err(
                        f"unknown counter '{c}'{_suggest(c, ['tokens', 'records'])}; counters: records, tokens",
                        n.pos,
                    )
            if len(set(counters)) != len(counters):
                raise _err("a counter is listed twice", opts["counters"].pos)
        guard = (
            self.bool_of(opts["guard-finite"], env, ":guard-finite")
            if "guard-finite" in opts
            else False
        )
        deterministic = (
            self.bool_of(opts["deterministic"], env, ":deterministic")
            if "deterministic" in opts
            else True
        )
        every = (
            self.int_of(opts["checkpoint-every"], env, ":checkpoint-every", 1)
            if "checkpoint-every" in opts
            else None
        )

        base_opt = self.optimizer_decl(opts["optimizer"], None) if "optimizer" in opts else None
        loss_node = opts.get("loss")
        stages: list[g.Stage] = []
        if "stages" in opts:
            if "steps" in opts:
                raise _err(
                    "with :stages, each stage has its own :steps; remove the run's :steps",
                    opts["steps"].pos,
                )
            node = opts["stages"]
            if not isinstance(node, (SList, SVec)) or not node.items:
                raise _err(
                    "(:stages ((stage warm :steps 10 ...) ...)) lists one or more stages", node.pos
                )
            names: set[str] = set()
            for sform in node.items:
                stage = self.stage(sform, opts, base_opt, loss_node, roots, names)
                stages.append(stage)
        else:
            if "steps" not in opts:
                raise _err("defrun needs :steps", form.pos)
            steps = self.int_of(opts["steps"], env, ":steps", 1)
            if "data" not in opts:
                raise _err("defrun needs :data naming a defdata", form.pos)
            if base_opt is None:
                raise _err("defrun needs :optimizer, e.g. :optimizer (adam :lr 0.001)", form.pos)
            if loss_node is None:
                raise _err(
                    "defrun needs :loss, e.g. :loss (cross-entropy (model inputs) targets)",
                    form.pos,
                )
            data = self.data_decl(opts["data"])
            stages.append(
                g.Stage("main", steps, data, base_opt, self.loss_graph(loss_node, data, roots))
            )
        evals: list[g.EvalPass] = []
        if loss_node is None and self.stage_losses:
            loss_node = self.stage_losses[0]  # an eval's `loss` is the first stage's then
        if "evals" in opts:
            node = opts["evals"]
            if not isinstance(node, (SList, SVec)):
                raise _err("(:evals ((eval probe :every 50 ...) ...)) lists eval passes", node.pos)
            for eform in node.items:
                evals.append(
                    self.eval_pass(eform, stages[0].data, loss_node, roots, {e.name for e in evals})
                )
        settings = g.RunSettings(run_name, every, seed, precision, counters, guard, deterministic)
        knobs = tuple(
            g.Knob(k.name, k.value, k.default, k.source, k.doc) for k in self.knobs.values()
        )
        return g.Program(
            file=file,
            sources=tuple(self.sources),
            knobs=knobs,
            variant=variant,
            params=tuple(self.params),
            run=settings,
            stages=tuple(stages),
            evals=tuple(evals),
            sites=tuple(self.sites.values()),
        )

    def with_loaded(self, node: Any, roots: Mapping[str, Instance]) -> tuple[str, Instance]:
        usage = (
            ':with-loaded (teacher (net 32 8) :file "teacher.safetensors" :names "{path}.weight")'
        )
        if not isinstance(node, SList) or len(node.items) < 2 or not isinstance(node.items[0], Sym):
            raise _err(f"expected {usage}", node.pos)
        name = node.items[0]
        if name.name in roots or "." in name.name:
            raise _err(f"a second root needs its own name, not '{name.name}'", name.pos)
        positional, keywords = _split_args(node.items[2:])
        if positional:
            raise _err(f"expected {usage}", positional[0].pos)
        opts = _keywords(keywords, ("file", "names"), "with-loaded")
        if "file" not in opts:
            raise _err(f"with-loaded needs :file: {usage}", node.pos)
        uri = self.static(opts["file"], {})
        if not isinstance(uri, str):
            raise _err(":file is a string", opts["file"].pos)
        uri = self.check_uri(uri, opts["file"].pos)
        template = "{path}"
        if "names" in opts:
            template = self.static(opts["names"], {})
            if not isinstance(template, str) or (
                "{path}" not in template and "{name}" not in template
            ):
                raise _err(
                    ':names maps a parameter to its tensor with {path} (teacher.ff.up) or {name} (ff.up), e.g. "{path}.weight"',
                    opts["names"].pos,
                )
        inst = self.instantiate(node.items[1], name.name, {}, (), {"loaded": (uri, template)})
        if not isinstance(inst, Instance):
            raise _err(
                "a second root is a layer such as (net 32 8), not a repeat", node.items[1].pos
            )
        return name.name, inst

    def stage(
        self,
        sform: Any,
        opts: Mapping[str, Any],
        base_opt: g.OptimizerDecl | None,
        loss_node: Any,
        roots: Mapping[str, Instance],
        names: set[str],
    ) -> g.Stage:
        name, s = _named_form(
            sform,
            "stage",
            "(stage name :steps N ...)",
            names,
            ("steps", "data", "optimizer", "loss"),
        )
        sname = name.name
        if "steps" not in s:
            raise _err(f"stage {sname} needs :steps", sform.pos)
        steps = self.int_of(s["steps"], {}, ":steps", 1)
        data_node = s.get("data", opts.get("data"))
        if data_node is None:
            raise _err(f"stage {sname} needs :data (or give the run :data)", sform.pos)
        optimizer = self.optimizer_decl(s["optimizer"], base_opt) if "optimizer" in s else base_opt
        if optimizer is None:
            raise _err(f"stage {sname} needs :optimizer (or give the run :optimizer)", sform.pos)
        lnode = s.get("loss", loss_node)
        if lnode is None:
            raise _err(f"stage {sname} needs :loss (or give the run :loss)", sform.pos)
        data = self.data_decl(data_node)
        self.stage_losses.append(lnode)
        return g.Stage(sname, steps, data, optimizer, self.loss_graph(lnode, data, roots))

    def loss_graph(self, node: Any, data: g.DataDecl, roots: Mapping[str, Instance]) -> g.Graph:
        b = Builder(self)
        out = self.scalar(node, "the loss", Ctx(b, None, {}, data.fields, roots))
        return b.graph([out])

    def scalar(self, node: Any, what: str, ctx: Ctx) -> T:
        v = self.expr(node, ctx)
        if not isinstance(v, T):
            raise _err(f"{what} must be a tensor expression, got {_describe(v)}", node.pos)
        if v.type.shape != ():
            raise _err(
                f"{what} must be a scalar, got {v.type}; reduce it, e.g. (mean ...)", node.pos
            )
        if v.type.dtype != "f32":
            if v.type.dtype not in O.FLOATS:
                raise _err(f"{what} must be floating, got {v.type}", node.pos)
            v = ctx.b.add("cast", [v], {"dtype": "f32"}, node.pos)
        return v

    def eval_pass(
        self,
        form: Any,
        default_data: g.DataDecl,
        loss_node: Any,
        roots: Mapping[str, Instance],
        taken: set[str],
    ) -> g.EvalPass:
        name, e = _named_form(
            form,
            "eval",
            "(eval name :every N :data d :metrics (loss))",
            taken,
            ("every", "data", "batches", "metrics"),
        )
        if "every" not in e:
            raise _err(f"eval {name.name} needs :every N (steps between passes)", form.pos)
        every = self.int_of(e["every"], {}, ":every", 1)
        batches = self.int_of(e["batches"], {}, ":batches", 1) if "batches" in e else 1
        data = self.data_decl(e["data"]) if "data" in e else default_data
        metric_nodes: list[Any] = [Sym("loss", form.pos)]
        if "metrics" in e:
            m = e["metrics"]
            if not isinstance(m, (SList, SVec)) or not m.items:
                raise _err("(:metrics (loss accuracy)) lists one or more metrics", m.pos)
            metric_nodes = list(m.items)
        b = Builder(self)
        ctx = Ctx(b, None, {}, data.fields, roots)
        names: list[str] = []
        outs: list[T] = []
        for mn in metric_nodes:
            if isinstance(mn, Sym) and mn.name == "loss":
                if loss_node is None:
                    raise _err("the metric loss needs the run's :loss", mn.pos)
                mname, out = "loss", self.scalar(loss_node, "the loss", ctx)
            elif isinstance(mn, Sym) and mn.name == "accuracy":
                for f in ("inputs", "targets"):
                    if f not in data.fields:
                        raise _err(
                            f"accuracy compares (model inputs) with targets; data '{data.name}' has no field {f}",
                            mn.pos,
                        )
                logits = self.call_layer(
                    roots["model"], [b.input("inputs", data.fields["inputs"], mn.pos)], mn.pos, ctx
                )
                if not isinstance(logits, T):
                    raise _err(
                        f"accuracy needs the model to give logits, got {_describe(logits)}", mn.pos
                    )
                targets = b.input("targets", data.fields["targets"], mn.pos)
                mname, out = "accuracy", b.add("accuracy", [logits, targets], {}, mn.pos)
            elif isinstance(mn, SList) and len(mn.items) == 2 and isinstance(mn.items[0], Sym):
                mname, out = (
                    mn.items[0].name,
                    self.scalar(mn.items[1], f"the metric {mn.items[0].name}", ctx),
                )
            else:
                raise _err(
                    f"a metric is loss, accuracy or (name expression), got {show(mn)}"
                    + (_suggest(mn.name, ["loss", "accuracy"]) if isinstance(mn, Sym) else ""),
                    mn.pos,
                )
            if mname in names:
                raise _err(f"metric '{mname}' is listed twice", mn.pos)
            names.append(mname)
            outs.append(out)
        return g.EvalPass(name.name, every, data, batches, tuple(names), b.graph(outs))


# ------------------------------------------------------------------ helpers


def _named_form(
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
        raise _err(f"{article} {what} is {usage}, got {show(form)}", form.pos)
    name = form.items[1]
    if name.name in taken:
        what = "eval pass" if head == "eval" else head
        raise _err(f"{what} '{name.name}' is listed twice", name.pos)
    taken.add(name.name)
    positional, keywords = _split_args(form.items[2:])
    if positional:
        raise _err(
            f"{head} takes :keyword value pairs, got {show(positional[0])}", positional[0].pos
        )
    return name, _keywords(keywords, allowed, head)


def _split_args(items: Iterable[Any]) -> tuple[list[Any], list[tuple[Kw, Any]]]:
    """Positional arguments, then ``:keyword value`` pairs (keywords come last)."""
    positional: list[Any] = []
    keywords: list[tuple[Kw, Any]] = []
    items = list(items)
    i = 0
    while i < len(items):
        x = items[i]
        if isinstance(x, Kw):
            if i + 1 >= len(items) or isinstance(items[i + 1], Kw):
                raise _err(f":{x.name} needs a value", x.pos)
            keywords.append((x, items[i + 1]))
            i += 2
            continue
        if keywords:
            raise _err(f"positional {show(x)} after keyword arguments", x.pos)
        positional.append(x)
        i += 1
    return positional, keywords


def _keywords(pairs: list[tuple[Kw, Any]], allowed: tuple[str, ...], what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kw, v in pairs:
        if kw.name not in allowed:
            listed = ", ".join(":" + a for a in allowed) if allowed else "none"
            raise _err(
                f"{what} has no option :{kw.name}{_suggest(kw.name, allowed)}; its options: {listed}",
                kw.pos,
            )
        if kw.name in out:
            raise _err(f":{kw.name} is given twice", kw.pos)
        out[kw.name] = v
    return out


def _static_apply(head: str, vals: list[Any], pos: Pos) -> Any:
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _err(f"{head} works on numbers here, got {_describe(v)}", pos)
    op = _BIN_SURFACE.get(head, {"max": "maximum", "min": "minimum"}.get(head, head))
    try:
        if op == "neg":
            if len(vals) != 1:
                raise _err("neg takes one argument", pos)
            return -vals[0]
        if op == "abs":
            if len(vals) != 1:
                raise _err("abs takes one argument", pos)
            return abs(vals[0])
        if head == "-" and len(vals) == 1:
            return -vals[0]
        if not vals or (len(vals) < 2 and op not in ("maximum", "minimum")):
            raise _err(f"{head} takes at least two arguments", pos)
        if op == "pow" and isinstance(vals[1], int) and abs(vals[1]) > 64:
            raise _err("pow's exponent is too large to compute before training", pos)
        acc = vals[0]
        for v in vals[1:]:
            acc = _STATIC_BIN[op](acc, v)
    except ZeroDivisionError:
        raise _err(f"{head}: division by zero", pos) from None
    except OverflowError:
        raise _err(f"{head}: the result is too large", pos) from None
    if isinstance(acc, complex) or (isinstance(acc, int) and abs(acc) > MAX_STATIC):
        raise _err(
            f"{head}: the result {acc if not isinstance(acc, int) else 'is too large'} cannot be used",
            pos,
        )
    return acc


def _resolve_shape(dims: tuple[int, ...], t: g.TensorType, pos: Pos) -> tuple[int, ...]:
    free = [i for i, d in enumerate(dims) if d == -1]
    if len(free) > 1 or any(d < -1 for d in dims):
        raise _err(f"reshape's shape {list(dims)} may hold one -1 and no other negative size", pos)
    if free:
        known = math.prod(d for d in dims if d != -1)
        total = math.prod(t.shape)
        if known == 0 or total % known:
            raise _err(f"reshape: cannot fit {t} ({total} values) into {list(dims)}", pos)
        dims = tuple(total // known if d == -1 else d for d in dims)
    return tuple(dims)


def _kind_text(knob: KnobDef) -> str:
    return {
        "int": "an integer",
        "float": "a number",
        "bool": "true or false",
        "str": "a string",
        "symbol": "a name",
    }[knob.kind]


def _parse_knob_text(knob: KnobDef, text: str) -> Any:
    """A ``--set`` value, typed by the knob's default."""
    kind = knob.kind
    try:
        if kind == "int":
            return int(text.strip(), 10)
        if kind == "float":
            v = float(text)
            if not math.isfinite(v):
                raise ValueError(text)
            return v
        if kind == "bool":
            low = text.strip().lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError(text)
        if kind == "symbol":
            if not re.fullmatch(r"[^\s()\[\]\";:][^\s()\[\]\";]*", text):
                raise ValueError(text)
            return text
        return text
    except ValueError:
        raise UsageError(
            f"--set {knob.name}={text}: knob '{knob.name}' takes {_kind_text(knob)}"
            f" (its default is {_show_value(knob.default)})"
        ) from None


def _show_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, str) else str(v)
