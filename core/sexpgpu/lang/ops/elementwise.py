"""Elementwise ops: arithmetic, activations and ``cast``; and the arithmetic the
compiler does on numbers known before training (the same names fold there)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sexpgpu.errors import Pos
from sexpgpu.lang import ir as g
from sexpgpu.lang.ir import TensorType
from sexpgpu.lang.ops.spec import Arg, Call, OpSpec, broadcast, check_float, promote
from sexpgpu.lang.text import describe, err, listing, suggest

MAX_STATIC = 2**62  # compile-time integers stay well inside int64

BIN_SURFACE = {
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
"""Surface names of the binary ops, to their IR op."""

STATIC_BIN: dict[str, Callable[[Any, Any], Any]] = {
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
"""The binary ops on numbers, for values known before training."""

STATIC_HEADS = (*BIN_SURFACE, "max", "min", "neg", "abs")
"""The heads :func:`static_apply` takes."""

BINARY = ("add", "sub", "mul", "div", "pow", "maximum", "minimum")
UNARY = ("neg", "relu", "gelu", "silu", "tanh", "sigmoid", "exp", "log", "sqrt", "rsqrt", "abs")
# unary ops that keep an integer tensor an integer tensor
_INT_UNARY = ("neg", "relu", "abs")
_STATIC_NAMES = {"max": "maximum", "min": "minimum"}


def static_apply(head: str, vals: list[Any], pos: Pos) -> Any:
    """``(head vals...)`` computed on numbers, or a positioned error."""
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise err(f"{head} works on numbers here, got {describe(v)}", pos)
    op = BIN_SURFACE.get(head, _STATIC_NAMES.get(head, head))
    try:
        if op in ("neg", "abs"):
            if len(vals) != 1:
                raise err(f"{op} takes one argument", pos)
            return -vals[0] if op == "neg" else abs(vals[0])
        if head == "-" and len(vals) == 1:
            return -vals[0]
        if not vals or (len(vals) < 2 and op not in ("maximum", "minimum")):
            raise err(f"{head} takes at least two arguments", pos)
        if op == "pow" and isinstance(vals[1], int) and abs(vals[1]) > 64:
            raise err("pow's exponent is too large to compute before training", pos)
        acc = vals[0]
        for v in vals[1:]:
            acc = STATIC_BIN[op](acc, v)
    except ZeroDivisionError:
        raise err(f"{head}: division by zero", pos) from None
    except OverflowError:
        raise err(f"{head}: the result is too large", pos) from None
    if isinstance(acc, complex) or (isinstance(acc, int) and abs(acc) > MAX_STATIC):
        raise err(
            f"{head}: the result {acc if not isinstance(acc, int) else 'is too large'} cannot be used",
            pos,
        )
    return acc


# ---------------------------------------------------------------- shape rules


def _binary_infer(
    op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos
) -> TensorType:
    a, b = args
    dtype = promote(a.dtype, b.dtype, op, pos)
    if op == "div" and dtype in ("i64", "bool"):
        dtype = "f32"  # true division, as torch does it
    return TensorType(broadcast(a.shape, b.shape, op, pos, a, b), dtype)


def _unary_infer(
    op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos
) -> TensorType:
    (x,) = args
    if op not in _INT_UNARY:
        check_float(op, x, pos)
    return x


def _cast_infer(
    op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos
) -> TensorType:
    (x,) = args
    return TensorType(x.shape, attrs["dtype"])


# ---------------------------------------------------------------- parsing hooks


def compile_binary(c: Call) -> Any:
    """``(+ a b c ...)``: folded while both sides are numbers, else one node per step."""
    name = c.name
    irop = BIN_SURFACE.get(name, _STATIC_NAMES.get(name))
    c.keywords(())
    if name == "-" and len(c.positional) == 1:
        v = c.value(0)
        if not c.is_tensor(v):
            return static_apply("neg", [v], c.pos)
        return c.add("neg", [v], {})
    c.arity(2, 99) if name in ("+", "*", "-", "max", "min") else c.arity(2)
    vals = [c.value(i) for i in range(len(c.positional))]
    acc = vals[0]
    for i, v in enumerate(vals[1:], start=1):
        if not c.is_tensor(acc) and not c.is_tensor(v):
            acc = static_apply(name, [acc, v], c.pos)
            continue
        like = acc.type.dtype if c.is_tensor(acc) else v.type.dtype
        left = c.constant(acc, c.positional[0].pos, like)
        right = c.constant(v, c.positional[i].pos, like)
        acc = c.add(irop, [left, right], {})
    return acc


def all_static(c: Call) -> bool:
    """Whether ``(max a b ...)`` is arithmetic on numbers: two or more, none a tensor."""
    return len(c.positional) >= 2 and all(
        not c.is_tensor(c.value(i)) for i in range(len(c.positional))
    )


def _compile_cast(c: Call) -> Any:
    c.arity(2)
    c.keywords(())
    x = c.tensor(0)
    dtype = c.word(c.positional[1], "a dtype")
    if dtype not in g.DTYPES:
        raise err(
            f"unknown dtype '{dtype}'{suggest(dtype, g.DTYPES)}; dtypes: {listing(g.DTYPES)}",
            c.positional[1].pos,
        )
    return c.add("cast", [x], {"dtype": dtype})


def _fold(name: str) -> Callable[[list[Any], Pos], Any]:
    return lambda vals, pos: static_apply(name, vals, pos)


_BINARY_SURFACES = {
    "add": ("+", "add"),
    "sub": ("-", "sub"),
    "mul": ("*", "mul"),
    "div": ("/", "div"),
}
_BINARY_DOCS = {
    "add": "a + b, numpy broadcasting",
    "sub": "a - b (one argument: -a)",
    "mul": "a * b",
    "div": "a / b (true division)",
    "pow": "a ** b",
    "maximum": "the larger of a and b, elementwise",
    "minimum": "the smaller of a and b, elementwise",
}
_UNARY_DOCS = {
    "neg": "-x",
    "relu": "max(x, 0)",
    "gelu": "the Gaussian error linear unit (exact)",
    "silu": "x * sigmoid(x)",
    "tanh": "tanh(x)",
    "sigmoid": "1 / (1 + exp(-x))",
    "exp": "e ** x",
    "log": "the natural logarithm",
    "sqrt": "the square root",
    "rsqrt": "1 / sqrt(x)",
    "abs": "|x|",
}

OPS: tuple[OpSpec, ...] = (
    *(
        OpSpec(
            name,
            _BINARY_DOCS[name],
            _binary_infer,
            (Arg("a"), Arg("b")),
            surface=_BINARY_SURFACES.get(name, ()),
            compile=compile_binary,
            positionwise=True,
        )
        for name in BINARY
    ),
    *(
        OpSpec(
            name,
            _UNARY_DOCS[name],
            _unary_infer,
            (Arg("x"),),
            fold=_fold(name) if name in ("neg", "abs") else None,
            positionwise=True,
        )
        for name in UNARY
    ),
    OpSpec(
        "cast",
        "x in another dtype (f32 bf16 i64 bool)",
        _cast_infer,
        compile=_compile_cast,
        positionwise=True,
    ),
)
"""The elementwise ops."""
