"""The op registry: every op of the language as an :class:`OpSpec` (docs/ir.md).

The built-in ops are registered here from their family modules
(:mod:`.elementwise`, :mod:`.tensor`, :mod:`.nn`, :mod:`.losses`,
:mod:`.select`); a plugin adds
more through the ``sexpgpu_ops`` hook. :func:`infer` types a node of any
built-in op, so a mismatch is reported where it was written, naming the op
and both shapes. This is public API for plugin authors and lowerings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sexpgpu.errors import Pos
from sexpgpu.lang.ir import TensorType
from sexpgpu.lang.ops import elementwise, losses, nn, select, tensor
from sexpgpu.lang.ops.elementwise import BINARY, UNARY
from sexpgpu.lang.ops.implementations import NO_IMPLEMENTATION, implementation_of
from sexpgpu.lang.ops.kernels import (
    KERNEL_CALLS,
    AttentionKernel,
    Conv2dKernel,
    StackBody,
    StackKernel,
)
from sexpgpu.lang.ops.spec import (
    FLOATS,
    REQUIRED,
    Arg,
    Call,
    Infer,
    Keyword,
    OpSpec,
    Registry,
    broadcast,
    check_axis,
    check_float,
    fail,
    int_attr,
    promote,
    same_float,
)

__all__ = [
    "KERNEL_CALLS",
    "AttentionKernel",
    "Conv2dKernel",
    "StackBody",
    "StackKernel",
    "BINARY",
    "BUILTINS",
    "FLOATS",
    "REQUIRED",
    "STRUCTURAL",
    "UNARY",
    "Arg",
    "Call",
    "Infer",
    "Keyword",
    "NO_IMPLEMENTATION",
    "OpSpec",
    "Registry",
    "broadcast",
    "builtin_ops",
    "check_axis",
    "check_float",
    "fail",
    "implementation_of",
    "infer",
    "int_attr",
    "promote",
    "same_float",
]

BUILTINS = Registry([*elementwise.OPS, *tensor.OPS, *nn.OPS, *losses.OPS, *select.OPS])
"""The built-in ops."""

STRUCTURAL = ("input", "param", "const", "repeat")
"""IR ops that are not ops of the language: the graph's own structure (docs/ir.md).
A lowering handles them itself; they have no spec."""


def builtin_ops() -> list[OpSpec]:
    """The built-in ops that add nodes: what every lowering implements."""
    return [s for s in BUILTINS.specs() if s.node]


def infer(op: str, args: Sequence[TensorType], attrs: Mapping[str, Any], pos: Pos) -> TensorType:
    """The type of built-in ``op`` applied to ``args`` with ``attrs``; raises a positioned
    :class:`sexpgpu.errors.SourceError` naming the op and the shapes when they do not fit."""
    spec = BUILTINS.get(op)
    if spec is None or spec.infer is None:
        raise fail(op, "is not an op", pos)
    return spec.infer(op, args, attrs, pos)
