"""The built-in kernels of the torch lowering, and the call signature of each kind.

A kernel registered through ``sexpgpu_kernels`` with ``lowering="torch"`` has a
``factory()`` that returns a callable with its kind's signature:

``attention``
    ``fn(q, k, v, *, heads: int, causal: bool) -> Tensor`` with ``q``, ``k``,
    ``v`` of shape ``[B, T, D]`` (``heads`` divides ``D``); returns ``[B, T, D]``,
    the heads concatenated back along the last axis. Must be differentiable
    through autograd.

``conv2d``
    ``fn(x, w, bias, *, stride: int, padding: int) -> Tensor`` with ``x``
    ``[B, C, H, W]``, ``w`` ``[O, C, kh, kw]`` and ``bias`` ``[O]`` or ``None``.

``stack``
    ``fn(body, carry, params) -> Tensor`` runs a ``repeat``: ``body(carry,
    slot_tensors) -> Tensor`` is one iteration, ``params`` holds one tuple of
    slot tensors per iteration; the output of one iteration is the carry of the
    next, and the last one is returned.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def _split_heads(x: Tensor, heads: int) -> Tensor:
    b, t, d = x.shape
    return x.reshape(b, t, heads, d // heads).transpose(1, 2)


def _merge_heads(x: Tensor) -> Tensor:
    b, h, t, hd = x.shape
    return x.transpose(1, 2).reshape(b, t, h * hd)


def attention_math(q: Tensor, k: Tensor, v: Tensor, *, heads: int, causal: bool) -> Tensor:
    """Attention written out: ``softmax(Q K^T / sqrt(d_head)) V`` per head, causal by mask."""
    qh, kh, vh = _split_heads(q, heads), _split_heads(k, heads), _split_heads(v, heads)
    scores = torch.matmul(qh, kh.transpose(-2, -1)) * (1.0 / math.sqrt(qh.shape[-1]))
    if causal:
        t_q, t_k = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(t_q, t_k, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return _merge_heads(torch.matmul(weights, vh))


def attention_sdpa(q: Tensor, k: Tensor, v: Tensor, *, heads: int, causal: bool) -> Tensor:
    """Attention through ``torch.nn.functional.scaled_dot_product_attention``."""
    out = F.scaled_dot_product_attention(
        _split_heads(q, heads), _split_heads(k, heads), _split_heads(v, heads), is_causal=causal
    )
    return _merge_heads(out)


def conv2d_direct(
    x: Tensor, w: Tensor, bias: Tensor | None, *, stride: int, padding: int
) -> Tensor:
    """2-D convolution through ``torch.nn.functional.conv2d``."""
    return F.conv2d(x, w, bias, stride=stride, padding=padding)


def stack_looped(
    body: Callable[[Tensor, Sequence[Tensor]], Tensor],
    carry: Tensor,
    params: Sequence[Sequence[Tensor]],
) -> Tensor:
    """Run the body once per iteration in a Python loop."""
    for slot_tensors in params:
        carry = body(carry, slot_tensors)
    return carry


def stack_unrolled(
    body: Callable[[Tensor, Sequence[Tensor]], Tensor],
    carry: Tensor,
    params: Sequence[Sequence[Tensor]],
) -> Tensor:
    """Every iteration inlined into the program's flat list of steps.

    The torch lowering recognises this kernel and inlines the body ``count``
    times when it compiles the graph, so no per-iteration dispatch is left at
    run time. Called directly (by another lowering), it is the plain loop.
    """
    for slot_tensors in params:
        carry = body(carry, slot_tensors)
    return carry
