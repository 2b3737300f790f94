"""What an op of the language is, as a value: :class:`OpSpec`, and the registry of them.

An op is described once: the names a `.sx` file calls it by, its positional
arguments and keywords (with defaults), the shape and dtype rule of the node
it adds (docs/ir.md), its choice-site kind if it has one, and a doc line. The
compiler parses a call from the spec; a lowering keeps one implementation per
op name. Built-in ops live in this package's family modules; a plugin supplies
more through the ``sexpgpu_ops`` hook (docs/plugins.md, "Adding an op").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sexpgpu.errors import Pos, SourceError
from sexpgpu.lang.ir import TensorType

__all__ = [
    "FLOATS",
    "REQUIRED",
    "Arg",
    "Call",
    "Infer",
    "Keyword",
    "OpSpec",
    "Registry",
    "broadcast",
    "fail",
    "promote",
    "promote_all",
]

FLOATS = ("f32", "bf16")


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
"""The default of a keyword that must be given."""

Infer = Callable[[str, Sequence[TensorType], Mapping[str, Any], Pos], TensorType]
"""``infer(op, arg_types, attrs, pos) -> TensorType``: the type of the node, or a
positioned :class:`SourceError` (see :func:`fail`) when the arguments do not fit."""


@dataclass(frozen=True)
class Arg:
    """A positional tensor argument.

    A number written in its place becomes a scalar constant: ``f32``, or an
    integer of ``like``'s dtype (``"i64"``; ``"@0"`` means the first argument's
    dtype, ``"@1"`` the second's). ``optional`` arguments come last and may be left out.
    """

    name: str
    like: str | None = None
    optional: bool = False


KEYWORD_KINDS = ("int", "number", "positive", "bool", "axis")
"""What a keyword's value may be: an integer (``low`` is its least value), any
number (stored as a float), a positive number (a float), true/false, or an axis
of the first tensor argument (negative counts from the end; stored >= 0)."""


@dataclass(frozen=True)
class Keyword:
    """A ``:name value`` option, known before training, stored in the node's attrs.

    ``default`` is :data:`REQUIRED` when the keyword must be given; ``example``
    then completes "OP needs :NAME, e.g. ...". ``default_from`` takes the default
    from another keyword's value (a pool's ``:stride`` is its ``:kernel``).
    """

    name: str
    kind: str
    default: Any = REQUIRED
    low: int | None = None
    example: str = ""
    default_from: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KEYWORD_KINDS:
            raise ValueError(
                f"keyword :{self.name}: kind {self.kind!r} is not one of {KEYWORD_KINDS}"
            )


class Call(Protocol):
    """One call of an op in a `.sx` expression, as a per-op ``compile`` hook sees it.

    The compiler supplies it; a hook reads its arguments through it and adds
    nodes with :meth:`add`. Argument indexes count positional arguments.
    """

    name: str
    pos: Pos
    positional: list[Any]

    def arity(self, lo: int, hi: int | None = None) -> None:
        """Refuse fewer than ``lo`` or more than ``hi`` positional arguments (99: no limit)."""

    def keywords(self, allowed: tuple[str, ...] = ()) -> dict[str, Any]:
        """The given keywords (name -> unevaluated node), each one of ``allowed``."""

    def value(self, i: int) -> Any:
        """Argument ``i`` compiled: a tensor or a value known before training."""

    def is_tensor(self, v: Any) -> bool:
        """Whether ``v`` (from :meth:`value`) is a tensor."""

    def tensor(self, i: int, like: str | None = None) -> Any:
        """Argument ``i`` as a tensor (a number becomes a constant of dtype ``like``)."""

    def constant(self, v: Any, pos: Pos, like: str | None = None) -> Any:
        """``v`` (a tensor or a number) as a tensor."""

    def static(self, node: Any, what: str) -> Any:
        """``node``'s value, which must be known before training."""

    def static_int(self, node: Any, what: str, low: int | None = None) -> int:
        """``node``'s integer value (at least ``low``)."""

    def axis(self, node: Any, t: Any, what: str = ":axis") -> int:
        """``node`` as an axis of tensor ``t`` (negative counts from the end)."""

    def word(self, node: Any, what: str) -> str:
        """A symbol written in place (``bf16``) or a name bound to one."""

    def describe(self, v: Any) -> str:
        """``v`` as an error message shows it."""

    def add(self, op: str, args: list[Any], attrs: dict[str, Any]) -> Any:
        """Add a node ``op`` (typed by its spec) at this call's place; its tensor."""

    def dropout_key(self) -> int:
        """The key that tells this call's dropout masks apart from every other's."""


@dataclass(frozen=True)
class OpSpec:
    """One op: what the compiler parses and checks, and what a lowering implements.

    ``name`` is the IR op on the nodes the op adds (``layer_norm``); ``surface``
    the names a `.sx` file calls it by (default: ``name`` with ``-`` for ``_``).
    ``args`` and ``keywords`` drive the compiler's parsing: arity, ``:name``
    options, defaults, and the node's attrs (keyword values, in this order).
    ``variadic`` lets the last argument repeat. ``infer`` types the node.
    ``site`` is the choice-site kind (``attention``, ``conv2d``) when kernels
    may implement it. ``compile`` is a per-op hook ``compile(call) -> value``
    replacing the generic parsing where a call's syntax is irregular; ``fold``
    computes the value of a call whose arguments are all known before training.
    ``node`` is false for a surface form that adds no node of its own
    (``flatten`` adds a ``reshape``). ``plugin`` names the plugin that supplied
    the op (``None`` for a built-in one). ``positionwise`` says the op works
    position by position: its result at an index of the leading axes depends only
    on its arguments at that index (a generator's key/value cache may then run it
    on the new positions alone; docs/generate.md): the elementwise built-ins say so.
    """

    name: str
    doc: str
    infer: Infer | None = None
    args: tuple[Arg, ...] = ()
    keywords: tuple[Keyword, ...] = ()
    surface: tuple[str, ...] = ()
    variadic: bool = False
    site: str | None = None
    compile: Callable[[Call], Any] | None = None
    fold: Callable[[list[Any], Pos], Any] | None = None
    node: bool = True
    plugin: str | None = None
    positionwise: bool = False

    @property
    def surfaces(self) -> tuple[str, ...]:
        """The names a `.sx` file calls this op by."""
        return self.surface or (self.name.replace("_", "-"),)

    def arity(self) -> tuple[int, int]:
        """The least and the most positional arguments (99: no limit)."""
        required = sum(1 for a in self.args if not a.optional)
        return required, 99 if self.variadic else len(self.args)


class Registry:
    """Op specs by IR name and by surface name; a surface name belongs to one spec."""

    def __init__(self, specs: Iterable[OpSpec] = ()) -> None:
        self._by_name: dict[str, OpSpec] = {}
        self._by_surface: dict[str, OpSpec] = {}
        for spec in specs:
            self.register(spec)

    def register(self, spec: OpSpec) -> None:
        """Add ``spec``; a name or surface name taken already is a ``ValueError``."""
        if spec.name in self._by_name:
            raise ValueError(f"op '{spec.name}' is registered twice")
        taken = [s for s in spec.surfaces if s in self._by_surface]
        if taken:
            raise ValueError(f"op '{spec.name}': surface name '{taken[0]}' is taken")
        if spec.node and spec.infer is None and spec.compile is None:
            raise ValueError(f"op '{spec.name}' adds a node but has no infer")
        self._by_name[spec.name] = spec
        for s in spec.surfaces:
            self._by_surface[s] = spec

    def get(self, name: str) -> OpSpec | None:
        """The spec of IR op ``name``."""
        return self._by_name.get(name)

    def surface(self, name: str) -> OpSpec | None:
        """The spec a `.sx` call of ``name`` means."""
        return self._by_surface.get(name)

    def specs(self) -> list[OpSpec]:
        """Every spec, in registration order."""
        return list(self._by_name.values())

    def names(self) -> set[str]:
        """The IR op names of the specs that add nodes (what a lowering implements)."""
        return {s.name for s in self._by_name.values() if s.node}

    def surface_names(self) -> list[str]:
        """Every surface name, sorted."""
        return sorted(self._by_surface)


# ---------------------------------------------------------------- helpers for infer functions


def fail(op: str, message: str, pos: Pos) -> SourceError:
    """The error an ``infer`` function raises: ``op: message`` at ``pos``."""
    return SourceError(f"{op}: {message}", pos=pos)


def promote(a: str, b: str, op: str, pos: Pos) -> str:
    """The dtype of an elementwise op on dtypes ``a`` and ``b``."""
    if a in FLOATS or b in FLOATS:
        if a in FLOATS and b in FLOATS:
            return "bf16" if a == b == "bf16" else "f32"
        return a if a in FLOATS else b
    if a == b:
        return a
    if {a, b} == {"i64", "bool"}:
        return "i64"
    raise fail(op, f"cannot combine {a} and {b}", pos)


def promote_all(op: str, args: Sequence[TensorType], pos: Pos) -> str:
    """The dtype an op computes in over all its tensor arguments (docs/ir.md, "Dtypes"):
    :func:`promote` applied left to right, so ``f32`` wins over ``bf16``."""
    dtype = args[0].dtype
    for t in args[1:]:
        dtype = promote(dtype, t.dtype, op, pos)
    return dtype


def broadcast(
    a: tuple[int, ...], b: tuple[int, ...], op: str, pos: Pos, ta: Any = None, tb: Any = None
) -> tuple[int, ...]:
    """Numpy broadcasting of two shapes, or a positioned error naming both."""
    out: list[int] = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x != y and x != 1 and y != 1:
            raise fail(
                op,
                f"shapes {ta or list(a)} and {tb or list(b)} do not broadcast"
                f" (axis -{i}: {x} vs {y})",
                pos,
            )
        out.append(max(x, y) if x != 1 and y != 1 else (x if y == 1 else y))
    return tuple(reversed(out))


def check_axis(op: str, axis: Any, ndim: int, pos: Pos, t: TensorType) -> None:
    """Refuse an ``axis`` that is not an integer in ``0..ndim-1``."""
    if not isinstance(axis, int) or isinstance(axis, bool) or not 0 <= axis < max(ndim, 0):
        raise fail(op, f"axis {axis} is out of range for {t}", pos)


def check_float(op: str, t: TensorType, pos: Pos, what: str = "its input") -> None:
    """Refuse a tensor that is not ``f32`` or ``bf16``."""
    if t.dtype not in FLOATS:
        raise fail(op, f"{what} must be a floating tensor (f32 or bf16), got {t}", pos)


def int_attr(op: str, attrs: Mapping[str, Any], name: str, pos: Pos, low: int = 0) -> int:
    """``attrs[name]`` as an integer of at least ``low``."""
    v = attrs.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise fail(op, f":{name} must be an integer >= {low}, got {v!r}", pos)
    return v


def same_float(
    op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos
) -> TensorType:
    """The rule of an elementwise function of one floating tensor: its own type."""
    (x,) = args
    check_float(op, x, pos)
    return x
