"""Neural-network ops: norms, attention, convolution, pooling and dropout."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sexpgpu.errors import Pos
from sexpgpu.lang.ir import TensorType
from sexpgpu.lang.ops.spec import (
    Arg,
    Call,
    Keyword,
    OpSpec,
    check_float,
    fail,
    int_attr,
    promote_all,
)
from sexpgpu.lang.text import describe, err

# ---------------------------------------------------------------- shape rules


def _norm(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    x, *rest = args
    check_float(op, x, pos)
    if not x.shape:
        raise fail(op, f"needs at least one axis, got {x}", pos)
    for name, t in zip(("weight", "bias"), rest, strict=False):
        if t.shape != (x.shape[-1],):
            raise fail(op, f"{name} {t} does not fit {x} (expected [{x.shape[-1]}])", pos)
        check_float(op, t, pos, name)
    return TensorType(x.shape, promote_all(op, args, pos))


def _attention(
    op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos
) -> TensorType:
    q, k, v = args
    for name, t in (("q", q), ("k", k), ("v", v)):
        if len(t.shape) != 3:
            raise fail(op, f"{name} must be [batch, time, dim], got {t}", pos)
        check_float(op, t, pos, name)
    if not (q.shape == k.shape == v.shape):
        raise fail(op, f"q {q}, k {k} and v {v} must have the same shape", pos)
    heads = int_attr(op, attrs, "heads", pos, 1)
    if q.shape[2] % heads:
        raise fail(op, f":heads {heads} does not divide the dim of {q}", pos)
    return TensorType(q.shape, promote_all(op, args, pos))


def _conv2d(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    x, w, *bias = args
    if len(x.shape) != 4:
        raise fail(op, f"the input must be [batch, channels, height, width], got {x}", pos)
    if len(w.shape) != 4:
        raise fail(op, f"the weight must be [out, in, kh, kw], got {w}", pos)
    check_float(op, x, pos)
    check_float(op, w, pos, "the weight")
    if w.shape[1] != x.shape[1]:
        raise fail(
            op,
            f"the weight {w} takes {w.shape[1]} channels but the input {x} has {x.shape[1]}",
            pos,
        )
    if bias and bias[0].shape != (w.shape[0],):
        raise fail(
            op, f"the bias {bias[0]} does not fit the weight {w} (expected [{w.shape[0]}])", pos
        )
    stride = int_attr(op, attrs, "stride", pos, 1)
    pad = int_attr(op, attrs, "padding", pos, 0)
    h = (x.shape[2] + 2 * pad - w.shape[2]) // stride + 1
    wd = (x.shape[3] + 2 * pad - w.shape[3]) // stride + 1
    if h < 1 or wd < 1:
        raise fail(op, f"the kernel {w} is larger than the padded input {x}", pos)
    return TensorType((x.shape[0], w.shape[0], h, wd), promote_all(op, args, pos))


def _pool(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    (x,) = args
    if len(x.shape) != 4:
        raise fail(op, f"the input must be [batch, channels, height, width], got {x}", pos)
    check_float(op, x, pos)
    kernel = int_attr(op, attrs, "kernel", pos, 1)
    stride = int_attr(op, attrs, "stride", pos, 1)
    h = (x.shape[2] - kernel) // stride + 1
    wd = (x.shape[3] - kernel) // stride + 1
    if h < 1 or wd < 1:
        raise fail(op, f":kernel {kernel} is larger than the input {x}", pos)
    return TensorType((x.shape[0], x.shape[1], h, wd), x.dtype)


def _dropout(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    (x,) = args
    check_float(op, x, pos)
    p = attrs["p"]
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p < 1:
        raise fail(op, f"p must be in [0, 1), got {p!r}", pos)
    return x


# ---------------------------------------------------------------- parsing hooks


def _compile_dropout(c: Call) -> Any:
    """``(dropout x 0.1)`` or ``(dropout x :p 0.1)``; its masks are keyed by the call."""
    c.arity(1, 2)
    opts = c.keywords(("p",))
    if len(c.positional) == 2 and "p" in opts:
        raise err("dropout: give p once", c.pos)
    pnode = c.positional[1] if len(c.positional) == 2 else opts.get("p")
    if pnode is None:
        raise err("dropout needs p: (dropout x 0.1)", c.pos)
    p = c.static(pnode, "dropout's p")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise err(f"dropout's p must be in [0, 1), got {describe(p)}", pnode.pos)
    return c.add("dropout", [c.tensor(0)], {"p": float(p), "key": c.dropout_key()})


def _pool_spec(name: str, doc: str) -> OpSpec:
    surface = name.replace("_", "-")
    return OpSpec(
        name,
        doc,
        _pool,
        (Arg("x"),),
        (
            Keyword("kernel", "int", low=1, example=f"({surface} x :kernel 2)"),
            Keyword("stride", "int", low=1, default_from="kernel"),
        ),
    )


OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "layer_norm",
        "layer normalisation of the last axis, with weight and bias",
        _norm,
        (Arg("x"), Arg("weight"), Arg("bias")),
        (Keyword("eps", "positive", 1e-5),),
    ),
    OpSpec(
        "rms_norm",
        "RMS normalisation of the last axis, with weight",
        _norm,
        (Arg("x"), Arg("weight")),
        (Keyword("eps", "positive", 1e-6),),
    ),
    OpSpec(
        "attention",
        "multi-head attention over [batch, time, dim] (causal by default)",
        _attention,
        (Arg("q"), Arg("k"), Arg("v")),
        (
            Keyword("heads", "int", low=1, example="(attention q k v :heads 4)"),
            Keyword("causal", "bool", True),
        ),
        site="attention",
    ),
    OpSpec(
        "conv2d",
        "2-D convolution of [B, C, H, W] by [O, C, kh, kw], with an optional bias",
        _conv2d,
        (Arg("x"), Arg("weight"), Arg("bias", optional=True)),
        (Keyword("stride", "int", 1, low=1), Keyword("padding", "int", 0, low=0)),
        site="conv2d",
    ),
    _pool_spec("max_pool2d", "max pooling of [B, C, H, W]"),
    _pool_spec("avg_pool2d", "average pooling of [B, C, H, W]"),
    OpSpec(
        "dropout",
        "zeroes each value with probability p in training",
        _dropout,
        compile=_compile_dropout,
        positionwise=True,
    ),
)
"""The neural-network ops."""
