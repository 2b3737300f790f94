"""Losses and metrics: cross-entropy, accuracy and mean squared error."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sexpgpu.errors import Pos
from sexpgpu.lang.ir import TensorType
from sexpgpu.lang.ops.spec import Arg, OpSpec, check_float, fail


def _classes(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    logits, targets = args
    if not logits.shape:
        raise fail(op, f"logits must be [..., classes], got {logits}", pos)
    check_float(op, logits, pos, "the logits")
    if targets.dtype != "i64":
        raise fail(op, f"targets must be i64 class indices, got {targets}", pos)
    if targets.shape != logits.shape[:-1]:
        raise fail(
            op,
            f"logits {logits} and targets {targets} do not fit"
            f" (targets must be [{', '.join(map(str, logits.shape[:-1]))}])",
            pos,
        )
    return TensorType((), "f32")


def _mse(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    p, t = args
    check_float(op, p, pos, "the prediction")
    if p.shape != t.shape:
        raise fail(op, f"prediction {p} and target {t} must have the same shape", pos)
    return TensorType((), "f32")


_CLASS_ARGS = (Arg("logits"), Arg("targets", like="i64"))

OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "cross_entropy",
        "mean cross-entropy over the positions whose target is >= 0",
        _classes,
        _CLASS_ARGS,
    ),
    OpSpec(
        "accuracy",
        "mean of argmax == target over the positions whose target is >= 0",
        _classes,
        _CLASS_ARGS,
    ),
    OpSpec("mse", "mean squared error", _mse, (Arg("prediction"), Arg("target", like="@0"))),
)
"""The losses and metrics."""
