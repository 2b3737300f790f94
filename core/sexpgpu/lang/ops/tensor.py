"""Tensor ops: matmul, shape changes, joins and slices, reductions, softmax, take,
and the compile-time questions ``shape`` and ``size``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from sexpgpu.errors import Pos
from sexpgpu.lang.ir import TensorType
from sexpgpu.lang.ops.elementwise import all_static, compile_binary
from sexpgpu.lang.ops.spec import (
    Arg,
    Call,
    Keyword,
    OpSpec,
    broadcast,
    check_axis,
    check_float,
    fail,
    promote,
    promote_all,
)
from sexpgpu.lang.reader import Atom
from sexpgpu.lang.text import describe, err

REDUCE = ("sum", "mean", "max")

# ---------------------------------------------------------------- shape rules


def _matmul(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    a, b = args
    check_float(op, a, pos, "a")
    check_float(op, b, pos, "b")
    dtype = promote(a.dtype, b.dtype, op, pos)
    if not a.shape or not b.shape:
        raise fail(op, f"cannot multiply {a} and {b}: both need at least one axis", pos)
    sa, sb = list(a.shape), list(b.shape)
    drop_a = drop_b = False
    if len(sa) == 1:
        sa, drop_a = [1, *sa], True
    if len(sb) == 1:
        sb, drop_b = [*sb, 1], True
    if sa[-1] != sb[-2]:
        raise fail(
            op, f"cannot multiply {a} and {b}: inner sizes {sa[-1]} and {sb[-2]} differ", pos
        )
    batch = broadcast(tuple(sa[:-2]), tuple(sb[:-2]), op, pos, a, b)
    shape = [*batch] + ([] if drop_a else [sa[-2]]) + ([] if drop_b else [sb[-1]])
    return TensorType(tuple(shape), dtype)


def _reshape(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    (x,) = args
    shape = tuple(attrs["shape"])
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise fail(op, f"shape {list(shape)} must hold non-negative integers", pos)
    if math.prod(shape) != math.prod(x.shape):
        raise fail(
            op,
            f"cannot reshape {x} ({math.prod(x.shape)} values) to {list(shape)}"
            f" ({math.prod(shape)} values)",
            pos,
        )
    return TensorType(shape, x.dtype)


def _transpose(
    op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos
) -> TensorType:
    (x,) = args
    i, j = attrs["axes"]
    check_axis(op, i, len(x.shape), pos, x)
    check_axis(op, j, len(x.shape), pos, x)
    shape = list(x.shape)
    shape[i], shape[j] = shape[j], shape[i]
    return TensorType(tuple(shape), x.dtype)


def _concat(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    first = args[0]
    axis = attrs["axis"]
    check_axis(op, axis, len(first.shape), pos, first)
    total = 0
    for t in args:
        if len(t.shape) != len(first.shape) or any(
            d != e for k, (d, e) in enumerate(zip(t.shape, first.shape, strict=True)) if k != axis
        ):
            raise fail(op, f"{first} and {t} differ outside axis {axis}", pos)
        total += t.shape[axis]
    shape = list(first.shape)
    shape[axis] = total
    return TensorType(tuple(shape), promote_all(op, args, pos))


def _slice(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    (x,) = args
    axis, start, stop = attrs["axis"], attrs["start"], attrs["stop"]
    check_axis(op, axis, len(x.shape), pos, x)
    if not (
        isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= x.shape[axis]
    ):
        raise fail(
            op,
            f"range {start}..{stop} is not within axis {axis} of {x} (size {x.shape[axis]})",
            pos,
        )
    shape = list(x.shape)
    shape[axis] = stop - start
    return TensorType(tuple(shape), x.dtype)


def _reduce(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    (x,) = args
    axes = tuple(attrs["axes"])
    for a in axes:
        check_axis(op, a, len(x.shape), pos, x)
    if list(axes) != sorted(set(axes)):
        raise fail(op, f"axes {list(axes)} must be sorted and distinct", pos)
    if op == "mean":
        check_float(op, x, pos)
    keep = bool(attrs["keepdim"])
    shape = tuple(1 if k in axes else d for k, d in enumerate(x.shape) if keep or k not in axes)
    return TensorType(shape, x.dtype)


def _softmax(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    (x,) = args
    check_float(op, x, pos)
    check_axis(op, attrs["axis"], len(x.shape), pos, x)
    return x


def _take(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    table, idx = args
    if not table.shape:
        raise fail(op, f"the table must have at least one axis, got {table}", pos)
    if idx.dtype != "i64":
        raise fail(op, f"indices must be i64, got {idx}", pos)
    return TensorType(idx.shape + table.shape[1:], table.dtype)


# ---------------------------------------------------------------- parsing hooks


def resolve_shape(dims: tuple[int, ...], t: TensorType, pos: Pos) -> tuple[int, ...]:
    """A reshape's target with its one ``-1`` worked out from ``t``'s size."""
    free = [i for i, d in enumerate(dims) if d == -1]
    if len(free) > 1 or any(d < -1 for d in dims):
        raise err(f"reshape's shape {list(dims)} may hold one -1 and no other negative size", pos)
    if free:
        known = math.prod(d for d in dims if d != -1)
        total = math.prod(t.shape)
        if known == 0 or total % known:
            raise err(f"reshape: cannot fit {t} ({total} values) into {list(dims)}", pos)
        dims = tuple(total // known if d == -1 else d for d in dims)
    return tuple(dims)


def _compile_reshape(c: Call) -> Any:
    c.arity(2)
    c.keywords(())
    x = c.tensor(0)
    node = c.positional[1]
    dims = c.static(node, "reshape's shape")
    if not isinstance(dims, tuple) or any(
        isinstance(d, bool) or not isinstance(d, int) for d in dims
    ):
        raise err(
            f"reshape's shape is a vector of integers such as [b -1], got {describe(dims)}",
            node.pos,
        )
    return c.add("reshape", [x], {"shape": resolve_shape(dims, x.type, node.pos)})


def _compile_flatten(c: Call) -> Any:
    c.arity(1)
    opts = c.keywords(("from",))
    x = c.tensor(0)
    start = c.axis(opts["from"], x, ":from") if "from" in opts else min(1, len(x.type.shape))
    shape = (*x.type.shape[:start], math.prod(x.type.shape[start:]))
    return c.add("reshape", [x], {"shape": shape})


def _compile_transpose(c: Call) -> Any:
    c.arity(1, 3)
    c.keywords(())
    x = c.tensor(0)
    if len(c.positional) == 2:
        raise err(
            "transpose takes a tensor and two axes, or just a tensor (the last two axes)", c.pos
        )
    if len(x.type.shape) < 2:
        raise err(f"transpose: needs at least two axes, got {x.type}", c.pos)
    if len(c.positional) == 3:
        axes = (c.axis(c.positional[1], x, "an axis"), c.axis(c.positional[2], x, "an axis"))
    else:
        nd = len(x.type.shape)
        axes = (nd - 2, nd - 1)
    return c.add("transpose", [x], {"axes": axes})


def _compile_slice(c: Call) -> Any:
    c.arity(1)
    opts = c.keywords(("axis", "start", "stop"))
    x = c.tensor(0)
    axis = c.axis(opts["axis"], x) if "axis" in opts else c.axis(-1, x)
    size = x.type.shape[axis]
    start = c.static_int(opts["start"], ":start") if "start" in opts else 0
    stop = c.static_int(opts["stop"], ":stop") if "stop" in opts else size
    start, stop = (start + size if start < 0 else start), (stop + size if stop < 0 else stop)
    return c.add("slice", [x], {"axis": axis, "start": start, "stop": stop})


def _compile_reduce(c: Call) -> Any:
    name = c.name
    if name == "max" and all_static(c):
        return compile_binary(c)
    c.arity(1)
    opts = c.keywords(("axis", "axes", "keepdim"))
    x = c.tensor(0)
    if "axis" in opts and "axes" in opts:
        raise err(f"{name} takes :axis or :axes, not both", c.pos)
    if "axis" in opts:
        axes: tuple[int, ...] = (c.axis(opts["axis"], x),)
    elif "axes" in opts:
        axes = _axes(c, opts["axes"], x)
    else:
        axes = tuple(range(len(x.type.shape)))
    keep = False
    if "keepdim" in opts:
        keep = c.static(opts["keepdim"], ":keepdim")
        if not isinstance(keep, bool):
            raise err(f":keepdim must be true or false, got {describe(keep)}", opts["keepdim"].pos)
    return c.add(name, [x], {"axes": axes, "keepdim": keep})


def _axes(c: Call, node: Any, x: Any) -> tuple[int, ...]:
    raw = c.static(node, ":axes")
    if not isinstance(raw, tuple):
        raise err(f":axes is a vector such as [0 1], got {describe(raw)}", node.pos)
    return tuple(
        sorted(
            {
                c.axis(Atom(a, node.pos), x, "an axis")
                if isinstance(a, int) and not isinstance(a, bool)
                else c.static_int(Atom(a, node.pos), "an axis")
                for a in raw
            }
        )
    )


def _compile_min(c: Call) -> Any:
    if all_static(c):
        return compile_binary(c)
    raise err(
        "min of a tensor is (neg (max (neg x))); (min a b) works on numbers and minimum on tensors",
        c.pos,
    )


def _compile_softmax(c: Call) -> Any:
    c.arity(1)
    opts = c.keywords(("axis",))
    x = c.tensor(0)
    if not x.type.shape:
        raise err(f"{c.name}: needs at least one axis, got {x.type}", c.pos)
    axis = c.axis(opts["axis"], x) if "axis" in opts else len(x.type.shape) - 1
    return c.add(c.name.replace("-", "_"), [x], {"axis": axis})


def _compile_shape(c: Call) -> Any:
    c.arity(1)
    c.keywords(())
    return c.tensor(0).type.shape


def _compile_size(c: Call) -> Any:
    c.arity(2)
    c.keywords(())
    x = c.tensor(0)
    return x.type.shape[c.axis(c.positional[1], x, "an axis")]


_AXIS = Keyword("axis", "axis", -1)

OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "matmul",
        "matrix product with torch.matmul's rules (1-D promoted, batch axes broadcast)",
        _matmul,
        (Arg("a"), Arg("b")),
    ),
    OpSpec(
        "reshape",
        "x with another shape of the same size (one -1 allowed)",
        _reshape,
        compile=_compile_reshape,
    ),
    OpSpec(
        "flatten",
        "the axes from :from on made one (a reshape)",
        compile=_compile_flatten,
        node=False,
    ),
    OpSpec(
        "transpose",
        "two axes swapped (default: the last two)",
        _transpose,
        compile=_compile_transpose,
    ),
    OpSpec("concat", "tensors joined along :axis", _concat, (Arg("x"),), (_AXIS,), variadic=True),
    OpSpec("slice", "a range :start..:stop of :axis", _slice, compile=_compile_slice),
    OpSpec("sum", "the sum over :axis or :axes (default all)", _reduce, compile=_compile_reduce),
    OpSpec("mean", "the mean over :axis or :axes (default all)", _reduce, compile=_compile_reduce),
    OpSpec(
        "max",
        "the maximum over :axis or :axes; on numbers, the largest",
        _reduce,
        compile=_compile_reduce,
    ),
    OpSpec(
        "min", "the smallest of numbers known before training", compile=_compile_min, node=False
    ),
    OpSpec("softmax", "softmax along :axis (default the last)", _softmax, compile=_compile_softmax),
    OpSpec(
        "log_softmax",
        "log of softmax along :axis (default the last)",
        _softmax,
        compile=_compile_softmax,
    ),
    OpSpec(
        "take",
        "rows of a table by i64 indices (an embedding lookup)",
        _take,
        (Arg("table"), Arg("indices", like="i64")),
    ),
    OpSpec(
        "shape",
        "a tensor's shape, as a vector known before training",
        compile=_compile_shape,
        node=False,
    ),
    OpSpec(
        "size", "the size of one axis, known before training", compile=_compile_size, node=False
    ),
)
"""The tensor ops."""
