"""The shape and dtype rules of every IR op (docs/ir.md), checked before any tensor exists.

:func:`infer` is the single place that knows what an op gives; the compiler
calls it for each node it adds, so a mismatch is reported where it was written,
naming the op and both shapes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from sexpgpu.errors import Pos, SourceError
from sexpgpu.graph import TensorType

__all__ = ["BINARY", "UNARY", "FLOATS", "infer", "broadcast", "promote"]

FLOATS = ("f32", "bf16")
BINARY = ("add", "sub", "mul", "div", "pow", "maximum", "minimum")
UNARY = ("neg", "relu", "gelu", "silu", "tanh", "sigmoid", "exp", "log", "sqrt", "rsqrt", "abs")
# unary ops that keep an integer tensor an integer tensor
_INT_UNARY = ("neg", "relu", "abs")
REDUCE = ("sum", "mean", "max")


def _fail(op: str, message: str, pos: Pos) -> SourceError:
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
    raise _fail(op, f"cannot combine {a} and {b}", pos)


def broadcast(
    a: tuple[int, ...], b: tuple[int, ...], op: str, pos: Pos, ta: Any = None, tb: Any = None
) -> tuple[int, ...]:
    """Numpy broadcasting of two shapes, or a positioned error naming both."""
    out: list[int] = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x != y and x != 1 and y != 1:
            raise _fail(
                op,
                f"shapes {ta or list(a)} and {tb or list(b)} do not broadcast"
                f" (axis -{i}: {x} vs {y})",
                pos,
            )
        out.append(max(x, y) if x != 1 and y != 1 else (x if y == 1 else y))
    return tuple(reversed(out))


def _axis(op: str, axis: Any, ndim: int, pos: Pos, t: TensorType) -> None:
    if not isinstance(axis, int) or isinstance(axis, bool) or not 0 <= axis < max(ndim, 0):
        raise _fail(op, f"axis {axis} is out of range for {t}", pos)


def _float(op: str, t: TensorType, pos: Pos, what: str = "its input") -> None:
    if t.dtype not in FLOATS:
        raise _fail(op, f"{what} must be a floating tensor (f32 or bf16), got {t}", pos)


def _int_attr(op: str, attrs: Mapping[str, Any], name: str, pos: Pos, low: int = 0) -> int:
    v = attrs.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise _fail(op, f":{name} must be an integer >= {low}, got {v!r}", pos)
    return v


def infer(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    """The type of ``op`` applied to ``args`` with ``attrs``; raises a positioned
    :class:`SourceError` naming the op and the shapes when they do not fit."""
    if op in BINARY:
        a, b = args
        dtype = promote(a.dtype, b.dtype, op, pos)
        if op == "div" and dtype in ("i64", "bool"):
            dtype = "f32"  # true division, as torch does it
        return TensorType(broadcast(a.shape, b.shape, op, pos, a, b), dtype)
    if op in UNARY:
        (x,) = args
        if op not in _INT_UNARY:
            _float(op, x, pos)
        return x
    if op == "matmul":
        return _matmul(args[0], args[1], pos)
    if op == "reshape":
        (x,) = args
        shape = tuple(attrs["shape"])
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise _fail(op, f"shape {list(shape)} must hold non-negative integers", pos)
        if math.prod(shape) != math.prod(x.shape):
            raise _fail(
                op,
                f"cannot reshape {x} ({math.prod(x.shape)} values) to {list(shape)}"
                f" ({math.prod(shape)} values)",
                pos,
            )
        return TensorType(shape, x.dtype)
    if op == "transpose":
        (x,) = args
        i, j = attrs["axes"]
        _axis(op, i, len(x.shape), pos, x)
        _axis(op, j, len(x.shape), pos, x)
        shape = list(x.shape)
        shape[i], shape[j] = shape[j], shape[i]
        return TensorType(tuple(shape), x.dtype)
    if op == "concat":
        first = args[0]
        axis = attrs["axis"]
        _axis(op, axis, len(first.shape), pos, first)
        total = 0
        for t in args:
            if len(t.shape) != len(first.shape) or any(
                d != e
                for k, (d, e) in enumerate(zip(t.shape, first.shape, strict=True))
                if k != axis
            ):
                raise _fail(op, f"{first} and {t} differ outside axis {axis}", pos)
            if t.dtype != first.dtype:
                raise _fail(op, f"{first} and {t} have different dtypes", pos)
            total += t.shape[axis]
        shape = list(first.shape)
        shape[axis] = total
        return TensorType(tuple(shape), first.dtype)
    if op == "slice":
        (x,) = args
        axis, start, stop = attrs["axis"], attrs["start"], attrs["stop"]
        _axis(op, axis, len(x.shape), pos, x)
        if not (
            isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= x.shape[axis]
        ):
            raise _fail(
                op,
                f"range {start}..{stop} is not within axis {axis} of {x} (size {x.shape[axis]})",
                pos,
            )
        shape = list(x.shape)
        shape[axis] = stop - start
        return TensorType(tuple(shape), x.dtype)
    if op in REDUCE:
        (x,) = args
        axes = tuple(attrs["axes"])
        for a in axes:
            _axis(op, a, len(x.shape), pos, x)
        if list(axes) != sorted(set(axes)):
            raise _fail(op, f"axes {list(axes)} must be sorted and distinct", pos)
        if op == "mean":
            _float(op, x, pos)
        keep = bool(attrs["keepdim"])
        shape = tuple(1 if k in axes else d for k, d in enumerate(x.shape) if keep or k not in axes)
        return TensorType(shape, x.dtype)
    if op in ("softmax", "log_softmax"):
        (x,) = args
        _float(op, x, pos)
        _axis(op, attrs["axis"], len(x.shape), pos, x)
        return x
    if op == "take":
        table, idx = args
        if not table.shape:
            raise _fail(op, f"the table must have at least one axis, got {table}", pos)
        if idx.dtype != "i64":
            raise _fail(op, f"indices must be i64, got {idx}", pos)
        return TensorType(idx.shape + table.shape[1:], table.dtype)
    if op in ("layer_norm", "rms_norm"):
        x, *rest = args
        _float(op, x, pos)
        if not x.shape:
            raise _fail(op, f"needs at least one axis, got {x}", pos)
        for name, t in zip(("weight", "bias"), rest, strict=False):
            if t.shape != (x.shape[-1],):
                raise _fail(op, f"{name} {t} does not fit {x} (expected [{x.shape[-1]}])", pos)
            _float(op, t, pos, name)
        return x
    if op == "attention":
        q, k, v = args
        for name, t in (("q", q), ("k", k), ("v", v)):
            if len(t.shape) != 3:
                raise _fail(op, f"{name} must be [batch, time, dim], got {t}", pos)
            _float(op, t, pos, name)
        if not (q.shape == k.shape == v.shape):
            raise _fail(op, f"q {q}, k {k} and v {v} must have the same shape", pos)
        heads = _int_attr(op, attrs, "heads", pos, 1)
        if q.shape[2] % heads:
            raise _fail(op, f":heads {heads} does not divide the dim of {q}", pos)
        return TensorType(q.shape, promote(q.dtype, k.dtype, op, pos))
    if op == "conv2d":
        x, w, *bias = args
        if len(x.shape) != 4:
            raise _fail(op, f"the input must be [batch, channels, height, width], got {x}", pos)
        if len(w.shape) != 4:
            raise _fail(op, f"the weight must be [out, in, kh, kw], got {w}", pos)
        _float(op, x, pos)
        _float(op, w, pos, "the weight")
        if w.shape[1] != x.shape[1]:
            raise _fail(
                op,
                f"the weight {w} takes {w.shape[1]} channels but the input {x} has {x.shape[1]}",
                pos,
            )
        if bias and bias[0].shape != (w.shape[0],):
            raise _fail(
                op, f"the bias {bias[0]} does not fit the weight {w} (expected [{w.shape[0]}])", pos
            )
        stride = _int_attr(op, attrs, "stride", pos, 1)
        pad = _int_attr(op, attrs, "padding", pos, 0)
        h = (x.shape[2] + 2 * pad - w.shape[2]) // stride + 1
        wd = (x.shape[3] + 2 * pad - w.shape[3]) // stride + 1
        if h < 1 or wd < 1:
            raise _fail(op, f"the kernel {w} is larger than the padded input {x}", pos)
        return TensorType((x.shape[0], w.shape[0], h, wd), promote(x.dtype, w.dtype, op, pos))
    if op in ("max_pool2d", "avg_pool2d"):
        (x,) = args
        if len(x.shape) != 4:
            raise _fail(op, f"the input must be [batch, channels, height, width], got {x}", pos)
        _float(op, x, pos)
        kernel = _int_attr(op, attrs, "kernel", pos, 1)
        stride = _int_attr(op, attrs, "stride", pos, 1)
        h = (x.shape[2] - kernel) // stride + 1
        wd = (x.shape[3] - kernel) // stride + 1
        if h < 1 or wd < 1:
            raise _fail(op, f":kernel {kernel} is larger than the input {x}", pos)
        return TensorType((x.shape[0], x.shape[1], h, wd), x.dtype)
    if op == "dropout":
        (x,) = args
        _float(op, x, pos)
        p = attrs["p"]
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p < 1:
            raise _fail(op, f"p must be in [0, 1), got {p!r}", pos)
        return x
    if op in ("cross_entropy", "accuracy"):
        logits, targets = args
        if not logits.shape:
            raise _fail(op, f"logits must be [..., classes], got {logits}", pos)
        _float(op, logits, pos, "the logits")
        if targets.dtype != "i64":
            raise _fail(op, f"targets must be i64 class indices, got {targets}", pos)
        if targets.shape != logits.shape[:-1]:
            raise _fail(
                op,
                f"logits {logits} and targets {targets} do not fit"
                f" (targets must be [{', '.join(map(str, logits.shape[:-1]))}])",
                pos,
            )
        return TensorType((), "f32")
    if op == "mse":
        p, t = args
        _float(op, p, pos, "the prediction")
        if p.shape != t.shape:
            raise _fail(op, f"prediction {p} and target {t} must have the same shape", pos)
        return TensorType((), "f32")
    if op == "cast":
        (x,) = args
        return TensorType(x.shape, attrs["dtype"])
    raise _fail(op, "is not an op", pos)  # the compiler only asks about known ops


def _matmul(a: TensorType, b: TensorType, pos: Pos) -> TensorType:
    op = "matmul"
    _float(op, a, pos, "a")
    _float(op, b, pos, "b")
    dtype = promote(a.dtype, b.dtype, op, pos)
    if not a.shape or not b.shape:
        raise _fail(op, f"cannot multiply {a} and {b}: both need at least one axis", pos)
    sa, sb = list(a.shape), list(b.shape)
    drop_a = drop_b = False
    if len(sa) == 1:
        sa, drop_a = [1, *sa], True
    if len(sb) == 1:
        sb, drop_b = [*sb, 1], True
    if sa[-1] != sb[-2]:
        raise _fail(
            op, f"cannot multiply {a} and {b}: inner sizes {sa[-1]} and {sb[-2]} differ", pos
        )
    batch = broadcast(tuple(sa[:-2]), tuple(sb[:-2]), op, pos, a, b)
    shape = [*batch] + ([] if drop_a else [sa[-2]]) + ([] if drop_b else [sb[-1]])
    return TensorType(tuple(shape), dtype)
