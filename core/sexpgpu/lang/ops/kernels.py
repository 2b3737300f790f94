"""The call contract of each kind of choice site: what an implementation of the
language's ``attention``, ``conv2d`` and ``repeat`` (kind ``stack``) must compute, so
that every lowering's kernels (``KernelInfo.factory()``) follow the same one.
Tensors are the lowering's (``torch.Tensor`` for the torch lowerings)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

Tensor = Any
"""A lowering's tensor; the core never imports one."""


class AttentionKernel(Protocol):
    """What an ``attention`` kernel's factory returns."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, heads: int, causal: bool) -> Tensor:
        """``q``, ``k``, ``v`` of shape ``[B, T, D]`` (``heads`` divides ``D``) to
        ``[B, T, D]``, the heads concatenated back along the last axis; masked so that
        a position sees none after it when ``causal``. Differentiable by the lowering's
        autograd."""


class Conv2dKernel(Protocol):
    """What a ``conv2d`` kernel's factory returns."""

    def __call__(
        self, x: Tensor, w: Tensor, bias: Tensor | None, *, stride: int, padding: int
    ) -> Tensor:
        """``x`` ``[B, C, H, W]``, ``w`` ``[O, C, kh, kw]``, ``bias`` ``[O]`` or ``None``
        to ``[B, O, H', W']``, with the same ``stride`` and zero ``padding`` on both axes."""


class StackBody(Protocol):
    """One iteration of a ``repeat``, as the lowering hands it to a stack kernel."""

    def __call__(self, carry: Tensor, slot_tensors: Sequence[Tensor]) -> Tensor:
        """The next carry from this one and the iteration's slot parameters, in slot order."""


class StackKernel(Protocol):
    """What a ``stack`` kernel's factory returns."""

    def __call__(
        self, body: StackBody, carry: Tensor, per_iteration_slots: Sequence[Sequence[Tensor]]
    ) -> Tensor:
        """Run ``body`` once per entry of ``per_iteration_slots``, in order, each output
        the next carry; return the last. An entry may carry an ``iteration`` attribute
        the body reads (it seeds dropout), so pass the entries as given."""


KERNEL_CALLS: Mapping[str, type] = {
    "attention": AttentionKernel,
    "conv2d": Conv2dKernel,
    "stack": StackKernel,
}
"""The call contract of each site kind the language has: what a kernel's factory returns."""
