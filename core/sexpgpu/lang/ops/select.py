"""Ops that compare, select and normalise: what a loss over records the model made
needs (a policy-gradient loss, a reward over generated tokens). Comparisons give
``bool`` tensors, ``where`` picks by one, ``argmax`` and ``gather`` find and read
positions along an axis, ``stop-gradient`` cuts a value out of the backward pass,
and ``group-mean``/``group-std`` normalise each record against the other samples of
its prompt (GRPO's group advantage)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sexpgpu.errors import Pos
from sexpgpu.lang.ir import TensorType
from sexpgpu.lang.ops.spec import (
    Arg,
    Keyword,
    OpSpec,
    broadcast,
    check_axis,
    check_float,
    fail,
    int_attr,
    promote,
)
from sexpgpu.lang.text import describe, err

COMPARISONS: dict[str, tuple[str, str, Callable[[Any, Any], bool]]] = {
    "lt": ("<", "a < b", operator.lt),
    "le": ("<=", "a <= b", operator.le),
    "gt": (">", "a > b", operator.gt),
    "ge": (">=", "a >= b", operator.ge),
    "eq": ("==", "a == b", operator.eq),
    "ne": ("!=", "a != b", operator.ne),
}
"""Each comparison's IR name, its surface symbol, what it computes (elementwise), and
how two numbers known before training compare."""


def _fold_compare(name: str) -> Callable[[list[Any], Pos], bool]:
    """A comparison of two numbers known before training (``(if (> layers 2) ...)``)."""

    def fold(values: list[Any], pos: Pos) -> bool:
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise err(f"{name} compares numbers or tensors, got {describe(v)}", pos)
        return COMPARISONS[name][2](*values)

    return fold


def _compare(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    a, b = args
    promote(a.dtype, b.dtype, op, pos)  # comparable at all
    return TensorType(broadcast(a.shape, b.shape, op, pos, a, b), "bool")


def _where(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    cond, a, b = args
    if cond.dtype != "bool":
        raise fail(op, f"the condition must be a bool tensor (a comparison), got {cond}", pos)
    shape = broadcast(a.shape, b.shape, op, pos, a, b)
    shape = broadcast(cond.shape, shape, op, pos, cond, TensorType(shape, a.dtype))
    return TensorType(shape, promote(a.dtype, b.dtype, op, pos))


def _argmax(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    (x,) = args
    if not x.shape:
        raise fail(op, f"needs at least one axis, got {x}", pos)
    axis = attrs["axis"]
    check_axis(op, axis, len(x.shape), pos, x)
    keep = bool(attrs["keepdim"])
    shape = tuple(1 if k == axis else d for k, d in enumerate(x.shape) if keep or k != axis)
    return TensorType(shape, "i64")


def _gather(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    x, idx = args
    axis = attrs["axis"]
    check_axis(op, axis, len(x.shape), pos, x)
    if idx.dtype != "i64":
        raise fail(op, f"indices must be i64, got {idx}", pos)
    if len(idx.shape) == len(x.shape) - 1:  # one position per row: the axis goes
        others = x.shape[:axis] + x.shape[axis + 1 :]
        if idx.shape != others:
            raise fail(
                op,
                f"indices {idx} must have the shape of {x} without axis {axis} "
                f"({list(others)}), or its rank",
                pos,
            )
        return TensorType(idx.shape, x.dtype)
    if len(idx.shape) != len(x.shape):
        raise fail(op, f"indices {idx} must have the rank of {x} or one less", pos)
    for k, (n, m) in enumerate(zip(idx.shape, x.shape, strict=True)):
        if k != axis and n != m:
            raise fail(op, f"indices {idx} and {x} differ on axis {k} ({n} vs {m})", pos)
    return TensorType(idx.shape, x.dtype)


def _stop_gradient(
    op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos
) -> TensorType:
    return args[0]


def _group(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    (x,) = args
    check_float(op, x, pos)
    size = int_attr(op, attrs, "size", pos, low=2 if op == "group_std" else 1)
    if not x.shape or x.shape[0] % size:
        raise fail(
            op,
            f"the first axis of {x} must hold whole groups of :size {size} "
            "(the samples of each prompt, one after another)",
            pos,
        )
    return x


_GROUP_SIZE = Keyword("size", "int", low=1, example=":size 4")

OPS: tuple[OpSpec, ...] = (
    *(
        OpSpec(
            name,
            f"{said} elementwise, numpy broadcasting; a bool tensor",
            _compare,
            (Arg("a"), Arg("b", like="@0")),
            surface=(symbol, name),
            fold=_fold_compare(name),
            positionwise=True,
        )
        for name, (symbol, said, _) in COMPARISONS.items()
    ),
    OpSpec(
        "where",
        "a where the bool cond holds, else b (broadcasting)",
        _where,
        (Arg("cond"), Arg("a"), Arg("b", like="@1")),
        positionwise=True,
    ),
    OpSpec(
        "argmax",
        "the i64 position of the largest value along :axis (the first, on ties)",
        _argmax,
        (Arg("x"),),
        (Keyword("axis", "axis", -1), Keyword("keepdim", "bool", False)),
    ),
    OpSpec(
        "gather",
        "x's values at the i64 indices along :axis (one per row, or indices of x's rank)",
        _gather,
        (Arg("x"), Arg("indices")),
        (Keyword("axis", "axis", -1),),
    ),
    OpSpec(
        "stop_gradient",
        "x, through which no gradient flows",
        _stop_gradient,
        (Arg("x"),),
        positionwise=True,
    ),
    OpSpec(
        "group_mean",
        "each value's group mean: the first axis in groups of :size",
        _group,
        (Arg("x"),),
        (_GROUP_SIZE,),
    ),
    OpSpec(
        "group_std",
        "each value's group standard deviation (n - 1): the first axis in groups of :size",
        _group,
        (Arg("x"),),
        (_GROUP_SIZE,),
    ),
)
"""The comparing, selecting and group ops."""
