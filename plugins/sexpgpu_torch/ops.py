"""The torch implementation of every built-in op: one table, op name -> builder.

A builder takes the node, the graph compiler building it (:class:`Lowerer`) and
the repeat iteration being inlined (``None`` outside one or in a body compiled
as a function), and returns the torch function of the node's argument values.
The table's keys are the core registry's op names
(:func:`sexpgpu.lang.ops.builtin_ops`); the structural ops ``input``,
``param``, ``const`` and ``repeat`` are the graph compiler's own. An op from a
plugin is built by :func:`plugin_op` from the implementation its plugin gives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from sexpgpu.errors import RunError
from sexpgpu.lang.ir import Node, TensorType
from sexpgpu.lang.ops import implementation_of
from sexpgpu_torch.contracts import check_op
from sexpgpu_torch.cross_entropy import cross_entropy, upcast_cross_entropy
from sexpgpu_torch.dtypes import TORCH_DTYPES
from sexpgpu_torch.names import LOWERING

Tensor = torch.Tensor
Fn = Callable[..., Tensor]

_FLOATS = ("f32", "bf16")


class Lowerer(Protocol):
    """What a builder may ask of the graph compiler."""

    kernels: Mapping[str, Callable[..., Any]]
    """The kernel chosen for each choice site, by site name."""
    plugin_ops: Sequence[Any]
    """The new ops plugins supply (``Supplies.ops``), for a node the table lacks."""
    device: torch.device
    """Where the graph runs (a plugin op is tried there when it has no meta kernel)."""
    align: int
    """The multiple a matrix product's inner and outer dimensions are padded to (0: as
    declared): the recorded ``cuda.align`` on a GPU, 0 on the CPU."""
    fuses: bool
    """Whether a compiler fuses the graph's elementwise work into the reductions that
    read it (the compiled lowering's inductor), so an upcast feeding a reduction is
    never a tensor of its own."""

    def arg_type(self, node: Node, i: int) -> TensorType:
        """The type of ``node``'s argument ``i``."""

    def dropout(self, p: float, key: int, iteration: int | None) -> Fn:
        """A dropout function with masks drawn from the run's seed, the step and ``key``."""


Builder = Callable[[Node, Lowerer, "int | None"], Fn]

_UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "neg": torch.neg,
    "relu": torch.relu,
    "gelu": F.gelu,
    "silu": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "exp": torch.exp,
    "log": torch.log,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "abs": torch.abs,
}

_BINARY: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "pow": torch.pow,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
}

_REDUCE: dict[str, Callable[..., Tensor]] = {
    "sum": torch.sum,
    "mean": torch.mean,
    "max": torch.amax,
}


def _accuracy(logits: Tensor, targets: Tensor) -> Tensor:
    # Masked positions (negative targets) count neither way, as in cross-entropy.
    scored = targets >= 0
    hits = (logits.argmax(dim=-1) == targets) & scored
    return hits.sum().float() / scored.sum().clamp(min=1).float()


def _mse(pred: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(pred.float(), target.float())


def _take(node: Node, table_shape: tuple[int, ...]) -> Callable[[Tensor, Tensor], Tensor]:
    """``take``: rows of a table by index. The shape checker knows an index's type,
    not its values, so an index beyond the table (data whose vocabulary is larger
    than the embedding) is found here, and told as the user's error at the ``take``."""
    rows = int(table_shape[0])
    gather = (
        (lambda table, idx: F.embedding(idx, table))
        if len(table_shape) == 2
        else (lambda table, idx: table[idx])
    )

    def take(table: Tensor, idx: Tensor) -> Tensor:
        try:
            return gather(table, idx)
        except IndexError:
            low, high = int(idx.min()), int(idx.max())
            bad = high if high >= rows else low
            raise RunError(
                f"{node.pos}: take: index {bad} is outside the table's {rows} rows "
                f"(indices here are {low}..{high}); is the data's vocabulary larger "
                "than the table?"
            ) from None

    return take


# ---------------------------------------------------------------- builders


def _unary(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    return _UNARY[node.op]


def _binary(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    return _BINARY[node.op]


_PROMOTING = frozenset(
    {*_BINARY, "matmul", "concat", "layer_norm", "rms_norm", "attention", "conv2d", "where"}
)
"""Ops over several floating tensors: each computes in its node's dtype, the IR's
promotion of its arguments' (docs/ir.md, "Dtypes"), so a ``bf16`` tensor next to an
``f32`` one is taken as ``f32`` where torch would refuse the pair (matmul, the norms,
attention, conv2d) or keep ``bf16`` against an ``f32`` scalar (the binary ops)."""


def _promoting(builder: Builder) -> Builder:
    """``builder`` whose function casts each floating argument of another dtype than
    the node's to the node's."""
    return lambda node, low, iteration: promoted(node, low, builder(node, low, iteration))


def promoted(node: Node, low: Lowerer, fn: Fn) -> Fn:
    """``fn`` casting each floating argument of another dtype than ``node``'s to it."""
    target = node.type.dtype
    if target not in _FLOATS:
        return fn
    dtypes = [low.arg_type(node, i).dtype for i in range(len(node.args))]
    casts = tuple(d in _FLOATS and d != target for d in dtypes)
    if not any(casts):
        return fn
    dt = TORCH_DTYPES[target]

    def promoted(*xs: Tensor) -> Tensor:
        return fn(*(x.to(dt) if cast else x for x, cast in zip(xs, casts, strict=True)))

    return promoted


def _reshape(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    shape = tuple(node.attrs["shape"])
    return lambda x: x.reshape(shape)


def _transpose(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    a0, a1 = node.attrs["axes"]
    return lambda x: x.transpose(a0, a1)


def _concat(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    axis = int(node.attrs["axis"])
    return lambda *xs: torch.cat(xs, dim=axis)


def _slice(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    attrs = node.attrs
    axis, start, stop = int(attrs["axis"]), int(attrs["start"]), int(attrs["stop"])
    return lambda x: x.narrow(axis, start, stop - start)


def _reduce(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    axes = tuple(node.attrs.get("axes", ()))
    keep = bool(node.attrs.get("keepdim", False))
    if not axes:  # reducing over no axis leaves x as it is (the IR's shape rule)
        return lambda x: x
    reduce = _REDUCE[node.op]
    return lambda x: reduce(x, dim=axes, keepdim=keep)


def _softmax(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    axis = int(node.attrs["axis"])
    fn = torch.softmax if node.op == "softmax" else torch.log_softmax
    return lambda x: fn(x, dim=axis)


def _layer_norm(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    eps = float(node.attrs.get("eps", 1e-5))
    return lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _rms_norm(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    eps = float(node.attrs.get("eps", 1e-6))
    return lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps)


def _attention(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    kernel = low.kernels[node.site]
    heads, causal = int(node.attrs["heads"]), bool(node.attrs.get("causal", False))
    return lambda q, k, v: kernel(q, k, v, heads=heads, causal=causal)


def _conv2d(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    kernel = low.kernels[node.site]
    stride, padding = int(node.attrs.get("stride", 1)), int(node.attrs.get("padding", 0))
    if len(node.args) == 2:
        return lambda x, w: kernel(x, w, None, stride=stride, padding=padding)
    return lambda x, w, b: kernel(x, w, b, stride=stride, padding=padding)


def _pool(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    size = int(node.attrs["kernel"])
    stride = int(node.attrs.get("stride", size))
    pool = F.max_pool2d if node.op == "max_pool2d" else F.avg_pool2d
    return lambda x: pool(x, size, stride)


def _cast(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    dt = TORCH_DTYPES[node.attrs["dtype"]]
    return lambda x: x.to(dt)


_COMPARE: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "lt": torch.lt,
    "le": torch.le,
    "gt": torch.gt,
    "ge": torch.ge,
    "eq": torch.eq,
    "ne": torch.ne,
}


def _compare(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    return _COMPARE[node.op]


def _argmax(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    axis, keep = int(node.attrs["axis"]), bool(node.attrs["keepdim"])
    return lambda x: torch.argmax(x, dim=axis, keepdim=keep)


def _gather(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    axis = int(node.attrs["axis"])
    if len(low.arg_type(node, 1).shape) == len(low.arg_type(node, 0).shape):
        return lambda x, i: torch.gather(x, axis, i)
    # one position per row: read it as a row of one, then drop that axis
    return lambda x, i: torch.gather(x, axis, i.unsqueeze(axis)).squeeze(axis)


def _group(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    size = int(node.attrs["size"])
    # torch's std divides by n - 1, as the group advantage of GRPO does
    statistic = torch.mean if node.op == "group_mean" else torch.std

    def grouped(x: Tensor) -> Tensor:
        groups = x.reshape(-1, size, *x.shape[1:])
        return statistic(groups, dim=1, keepdim=True).expand_as(groups).reshape(x.shape)

    return grouped


def _matmul(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    """``matmul``, its inner (K) and outer (N) dimensions padded with zeros to a
    multiple of ``low.align`` and the padded outputs cut off again: the values are the
    declared product's, computed by the GPU's aligned kernels (cuBLAS reads a row-major
    ``[M, K] x [K, N]`` with leading dimensions K and N; M sets none). Under
    ``torch.compile`` the padding fuses into the operand's cast to bf16 and the cut
    into what reads the product, so neither is a pass over memory of its own."""
    a, b = low.arg_type(node, 0).shape, low.arg_type(node, 1).shape
    if not low.align or len(a) < 2 or len(b) < 2:
        return torch.matmul
    k, n = b[-2], b[-1]
    pad_k, pad_n = -k % low.align, -n % low.align
    if not (pad_k or pad_n):
        return torch.matmul

    def aligned(x: Tensor, w: Tensor) -> Tensor:
        if pad_k:
            x = F.pad(x, (0, pad_k))
        out = torch.matmul(x, F.pad(w, (0, pad_n, 0, pad_k)))
        return out[..., :n] if pad_n else out

    return aligned


def _fixed(fn: Fn) -> Builder:
    return lambda node, low, iteration: fn


_TABLE: dict[str, Builder] = {
    **{name: _unary for name in _UNARY},
    **{name: _binary for name in _BINARY},
    "matmul": _matmul,
    "reshape": _reshape,
    "transpose": _transpose,
    "concat": _concat,
    "slice": _slice,
    **{name: _reduce for name in _REDUCE},
    "softmax": _softmax,
    "log_softmax": _softmax,
    "take": lambda node, low, iteration: _take(node, low.arg_type(node, 0).shape),
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "attention": _attention,
    "conv2d": _conv2d,
    "max_pool2d": _pool,
    "avg_pool2d": _pool,
    "dropout": lambda node, low, it: low.dropout(
        float(node.attrs["p"]), int(node.attrs["key"]), it
    ),
    "cross_entropy": lambda node, low, it: upcast_cross_entropy if low.fuses else cross_entropy,
    "accuracy": _fixed(_accuracy),
    "mse": _fixed(_mse),
    "cast": _cast,
    **{name: _compare for name in _COMPARE},
    "where": _fixed(torch.where),
    "argmax": _argmax,
    "gather": _gather,
    "stop_gradient": _fixed(torch.Tensor.detach),
    "group_mean": _group,
    "group_std": _group,
}

IMPLEMENTATIONS: dict[str, Builder] = {
    name: _promoting(builder) if name in _PROMOTING else builder for name, builder in _TABLE.items()
}
"""Each built-in op's builder: ``builder(node, lowerer, iteration) -> fn(*args)``."""


def build(node: Node, low: Lowerer, iteration: int | None) -> Fn:
    """The torch function computing ``node``: a built-in op's, or its plugin's."""
    builder = IMPLEMENTATIONS.get(node.op)
    if builder is not None:
        return builder(node, low, iteration)
    return plugin_op(node, low)


def plugin_op(node: Node, low: Lowerer) -> Fn:
    """A plugin op's function: its plugin's torch implementation among ``plugin_ops``,
    given the node's keywords (``implementation(attrs) -> fn(*tensors)``)."""
    factory = implementation_of(
        node.op, node.attrs.get("plugin"), LOWERING, low.plugin_ops, node.pos
    )
    attrs = {k: v for k, v in node.attrs.items() if k != "plugin"}
    try:
        fn = factory()(attrs)
    except Exception as exc:  # a plugin's bug is told as its op's, never a traceback
        raise RunError(
            f"the op '{node.op}' from the plugin '{node.attrs.get('plugin')}' failed to build:"
            f" {type(exc).__name__}: {exc}",
            pos=node.pos,
        ) from None
    check_op(fn, node, [low.arg_type(node, i) for i in range(len(node.args))], low.device)
    return fn
