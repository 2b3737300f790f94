"""The built-in optimizers' updates through torch's fused kernels (``torch._fused_sgd_``,
``torch._fused_adam_``, ``torch._fused_adamw_``): the compiled strategy's update when
the recorded choice ``optimizer.update`` is ``fused`` (:mod:`sexpgpu_torch.compiled`).

These are the kernels ``torch.optim`` runs with ``fused=True`` (what a nanoGPT-style
script asks for): one pass over every tensor reads a parameter, its gradient and its
states and writes the new parameter and states, on the CPU and on CUDA. Nothing of
them is traced or compiled, so a start compiles no update graph (about a fifth of a
cold compile, and every warm start's trace of it). The arithmetic is theirs, not the
eager update's term by term: another summation order, so another choice with other
bits, recorded and pinned on resume; ``compiled`` (the update as one compiled graph,
:mod:`sexpgpu_torch.compiled_optim`) keeps the eager lowering's terms.

A fused kernel writes into the tensors it is given. The protocol's ``propose``
leaves its inputs untouched (the finite guard may refuse the proposal), so the
parameters and states are first copied, unless the trainer says nothing will read
them again (``overwrites``: no guard checks the proposal, and the placement commits
the same tensors), which spares a read and a write of each. A plugin's optimizer
runs its own ``propose``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

import sexpgpu_torch.optim as eager

Tensor = torch.Tensor


def _fresh(tensors: Sequence[Tensor], given: Sequence[Tensor], overwrites: bool) -> list[Tensor]:
    """``tensors`` to write into: each a copy where it is one of ``given`` (the caller's,
    which must stay as they are) unless ``overwrites``, and wherever it is not
    contiguous (:func:`_readable`)."""
    return [
        t.contiguous() if not t.is_contiguous() else t.clone() if t is g and not overwrites else t
        for t, g in zip(tensors, given, strict=True)
    ]


def _readable(tensors: Sequence[Tensor]) -> list[Tensor]:
    # The fused kernels walk each tensor's memory in order, whatever its strides: on
    # the CPU a transposed gradient is read in the wrong order, silently (autograd
    # hands back a gradient in whatever layout its last op made).
    return [t.contiguous() for t in tensors]


def _at(values: Sequence[Any], where: Sequence[int]) -> list[Any]:
    return [values[i] for i in where]


def _sgd(params, grads, states, *, lr, count, options, decay, overwrites):  # noqa: ANN001
    momentum = float(options.get("momentum", 0.0))
    new = _fresh(eager.as_f32(params), params, overwrites)
    bufs = _fresh(list(states["momentum"]), states["momentum"], overwrites) if momentum else []
    torch._fused_sgd_(
        new,
        _readable(eager.as_f32(grads)),
        bufs,
        weight_decay=float(options.get("weight_decay", 0.0)),
        momentum=momentum,
        lr=eager.f32_scalar(lr),
        dampening=0.0,
        nesterov=bool(options.get("nesterov", False)),
        maximize=False,
        is_first_step=False,  # the buffers start at zero: momentum * 0 + g, as eager's
    )
    return eager.back_to(new, params), ({"momentum": bufs} if momentum else {})


def _adam(decoupled: bool) -> Callable[..., Any]:
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_

    def update(params, grads, states, *, lr, count, options, decay, overwrites):  # noqa: ANN001
        new = _fresh(eager.as_f32(params), params, overwrites)
        m = _fresh(list(states["m"]), states["m"], overwrites)
        v = _fresh(list(states["v"]), states["v"], overwrites)
        g = _readable(eager.as_f32(grads))
        # the kernels read the update count from a tensor on the parameters' device (a
        # fill there, no transfer); one serves every parameter, as it is only read
        step = torch.full((), float(count), dtype=torch.float32, device=new[0].device)
        wd = float(options.get("weight_decay", 0.0))
        # adamw decays only the flagged tensors; adam's L2 decay goes into every gradient
        every = range(len(new))
        groups = (
            [([i for i in every if decay[i]], wd), ([i for i in every if not decay[i]], 0.0)]
            if decoupled
            else [(every, wd)]
        )
        for where, decay_by in groups:
            if not where:
                continue
            kernel(
                *(_at(values, where) for values in (new, g, m, v)),
                [],
                [step] * len(where),
                lr=eager.f32_scalar(lr),
                beta1=float(options.get("beta1", 0.9)),
                beta2=float(options.get("beta2", 0.999)),
                weight_decay=decay_by,
                eps=float(options.get("eps", 1e-8)),
                amsgrad=False,
                maximize=False,
            )
        return eager.back_to(new, params), {"m": m, "v": v}

    return update


_FUSED: dict[type, Callable[..., Any]] = {
    eager.SGD: _sgd,
    eager.Adam: _adam(False),
    eager.AdamW: _adam(True),
}
"""Each built-in update's fused form."""


def fusable(update: Any) -> bool:
    """Whether ``update`` (an optimizer's update) has a fused form here."""
    return type(update) in _FUSED


class FusedUpdate(eager.StandIn):
    """A built-in update through torch's fused kernel (:class:`~sexpgpu_torch.optim.StandIn`
    of the eager update; a plugin's runs its own ``propose``). ``overwrites``: see the
    module's docstring."""

    def __init__(self, update: Any, *, overwrites: bool = False) -> None:
        super().__init__(update, _FUSED.get(type(update)))
        self.overwrites = overwrites

    def propose_by_form(self, params, grads, states, *, lr, count, options, decay):  # noqa: ANN001
        """New parameters and states through the fused kernel."""
        return self.form(
            params,
            grads,
            states,
            lr=lr,
            count=count,
            options=options,
            decay=list(decay),
            overwrites=self.overwrites,
        )
