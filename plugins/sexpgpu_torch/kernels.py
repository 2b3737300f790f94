"""The torch plugin's kernels, for either device.

Each follows its kind's call contract in the core (:data:`sexpgpu.lang.ops.KERNEL_CALLS`:
:class:`~sexpgpu.lang.ops.AttentionKernel`, :class:`~sexpgpu.lang.ops.Conv2dKernel`,
:class:`~sexpgpu.lang.ops.StackKernel`), with ``torch.Tensor`` as the tensor type;
a third-party kernel for ``lowering="torch"`` follows the same contracts. Every
kernel here but ``recompute`` is the eager lowering's, which the compiled lowering
calls too; ``recompute`` is the compiled lowering's own (its descriptors are in
:mod:`sexpgpu_torch`). The CUDA-only kernels are the ``cuda`` plugin's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from sexpgpu.lang.ops import AttentionKernel, Conv2dKernel, StackBody, StackKernel
from sexpgpu_torch.graphs import Slots

Tensor = torch.Tensor


def split_heads(x: Tensor, heads: int) -> Tensor:
    """``[b, t, d]`` as ``[b, heads, t, d / heads]`` (a view)."""
    b, t, d = x.shape
    return x.reshape(b, t, heads, d // heads).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """``[b, heads, t, hd]`` back as ``[b, t, heads * hd]``."""
    b, h, t, hd = x.shape
    return x.transpose(1, 2).reshape(b, t, h * hd)


def attention_math(q: Tensor, k: Tensor, v: Tensor, *, heads: int, causal: bool) -> Tensor:
    """Attention written out: ``softmax(Q K^T / sqrt(d_head)) V`` per head, causal by mask."""
    qh, kh, vh = split_heads(q, heads), split_heads(k, heads), split_heads(v, heads)
    scores = torch.matmul(qh, kh.transpose(-2, -1)) * (1.0 / math.sqrt(qh.shape[-1]))
    if causal:
        t_q, t_k = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(t_q, t_k, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return merge_heads(torch.matmul(weights, vh))


def attention_sdpa(q: Tensor, k: Tensor, v: Tensor, *, heads: int, causal: bool) -> Tensor:
    """Attention through ``torch.nn.functional.scaled_dot_product_attention``."""
    out = F.scaled_dot_product_attention(
        split_heads(q, heads), split_heads(k, heads), split_heads(v, heads), is_causal=causal
    )
    return merge_heads(out)


def conv2d_direct(
    x: Tensor, w: Tensor, bias: Tensor | None, *, stride: int, padding: int
) -> Tensor:
    """2-D convolution through ``torch.nn.functional.conv2d``."""
    return F.conv2d(x, w, bias, stride=stride, padding=padding)


def stack_looped(
    body: StackBody, carry: Tensor, per_iteration_slots: Sequence[Sequence[Tensor]]
) -> Tensor:
    """Run the body once per iteration in a Python loop."""
    for slot_tensors in per_iteration_slots:
        carry = body(carry, slot_tensors)
    return carry


def stack_unrolled(
    body: StackBody, carry: Tensor, per_iteration_slots: Sequence[Sequence[Tensor]]
) -> Tensor:
    """Every iteration inlined into the graph's straight-line function.

    Its descriptor says ``inline``, so the torch lowering emits the body ``count``
    times when it compiles the graph and no per-iteration dispatch is left at run
    time. Called (by a lowering that does not inline), it is the plain loop, which
    computes the same values.
    """
    for slot_tensors in per_iteration_slots:
        carry = body(carry, slot_tensors)
    return carry


# Under torch.compile the checkpoint is traced as one region whose forward the
# backward graph computes again; the body keeps the iteration it runs in its own
# values (sexpgpu_torch.graphs), since a region may not write outside itself.
def stack_recompute(
    body: StackBody, carry: Tensor, per_iteration_slots: Sequence[Sequence[Tensor]]
) -> Tensor:
    """Each iteration under activation checkpointing: its activations are dropped after
    the forward pass and computed again in the backward pass (memory for compute).
    Dropout draws the same masks both times (they derive from the step and iteration)."""
    for slots in per_iteration_slots:
        iteration = getattr(slots, "iteration", 0)

        def one(c: Tensor, *tensors: Tensor, iteration: int = iteration) -> Tensor:
            return body(c, Slots(tensors, iteration))

        carry = checkpoint(one, carry, *slots, use_reentrant=False)
    return carry


# Through these a type checker holds each built-in kernel to its kind's contract.
_ATTENTION: tuple[AttentionKernel, ...] = (attention_math, attention_sdpa)
_CONV2D: tuple[Conv2dKernel, ...] = (conv2d_direct,)
_STACK: tuple[StackKernel, ...] = (stack_looped, stack_unrolled, stack_recompute)
