"""Propose-then-commit optimizer updates for the torch lowering.

Each update follows the core's protocol, :class:`sexpgpu.extension.OptimizerUpdate`
(``init_states`` and ``propose``; the inputs are never modified, so a refused
proposal changes nothing), with ``torch.Tensor`` as the tensor type. Here
specifically: every update uses ``torch._foreach_*`` ops over the whole list,
never a Python loop per parameter; parameters stored in ``bf16`` are updated in
``f32`` and rounded back; their states are kept in ``f32``; adamw skips the decay
of parameters tagged with one of ``no_decay_tags`` (the ``decay`` flags).

The lowering clips the gradients (:func:`clip_by_global_norm`) before ``propose``
and derives ``count`` from the global step number and the first step of the run
of stages that share these states (see
:meth:`sexpgpu_torch.trainer.TorchTrainer.propose`), which survives a resume.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from sexpgpu.extension import OptimizerUpdate

Tensor = torch.Tensor


def as_f32(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Each tensor in f32, the dtype every update computes in (an f32 one as it is, so
    a trace of the compiled update gets no op for it)."""
    return [t if t.dtype == torch.float32 else t.float() for t in tensors]


def back_to(new: Sequence[Tensor], like: Sequence[Tensor]) -> list[Tensor]:
    """Each new value in the dtype of the parameter it replaces."""
    return [n if n.dtype == o.dtype else n.to(o.dtype) for n, o in zip(new, like, strict=True)]


class Update(OptimizerUpdate):
    """Base of the built-in updates, each an :class:`sexpgpu.extension.OptimizerUpdate`."""

    state_names: tuple[str, ...] = ()

    def names(self, options: Mapping[str, Any]) -> tuple[str, ...]:
        """The states kept for ``options``."""
        return self.state_names

    def init_states(
        self, params: Sequence[Tensor], options: Mapping[str, Any]
    ) -> dict[str, list[Tensor]]:
        """Zeroed f32 states, one list per state name, aligned with ``params``."""
        return {
            name: [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]
            for name in self.names(options)
        }

    def propose(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        states: Mapping[str, Sequence[Tensor]],
        *,
        lr: float,
        count: int,
        options: Mapping[str, Any],
        decay: Sequence[bool],
    ) -> tuple[list[Tensor], dict[str, list[Tensor]]]:
        """New parameters and states; the inputs are not modified."""
        raise NotImplementedError


class SGD(Update):
    """SGD as torch.optim.SGD computes it (dampening 0): L2 decay into the gradient,
    ``buf = momentum * buf + g``, nesterov ``g + momentum * buf``."""

    elementwise = True  # each element from the same element alone: slices update alike

    def names(self, options: Mapping[str, Any]) -> tuple[str, ...]:
        return ("momentum",) if float(options.get("momentum", 0.0)) > 0 else ()

    def propose(self, params, grads, states, *, lr, count, options, decay):
        momentum = float(options.get("momentum", 0.0))
        wd = float(options.get("weight_decay", 0.0))
        nesterov = bool(options.get("nesterov", False))
        p32 = as_f32(params)
        g = as_f32(grads)
        if wd:
            g = torch._foreach_add(g, p32, alpha=wd)
        new_states: dict[str, list[Tensor]] = {}
        if momentum > 0:
            buf = torch._foreach_mul(list(states["momentum"]), momentum)
            torch._foreach_add_(buf, g)
            new_states["momentum"] = buf
            g = torch._foreach_add(g, buf, alpha=momentum) if nesterov else buf
        new = torch._foreach_add(p32, g, alpha=f32_scalar(-lr))
        return back_to(new, params), new_states


_F32_MAX = 3.4028234663852886e38


def f32_scalar(value: float) -> float:
    """``value`` as the f32 kernels take it: a finite value beyond f32's range becomes
    infinite (as f32 arithmetic would make it) instead of failing the conversion, so a
    huge learning rate proposes infinite values that the finite guard can refuse."""
    if math.isfinite(value) and abs(value) > _F32_MAX:
        return math.copysign(math.inf, value)
    return value


class Adam(Update):
    """Adam as torch.optim.Adam computes it; ``decoupled`` makes it AdamW."""

    state_names = ("m", "v")
    decoupled = False
    elementwise = True  # each element from the same element alone: slices update alike

    def propose(self, params, grads, states, *, lr, count, options, decay):
        beta1 = float(options.get("beta1", 0.9))
        beta2 = float(options.get("beta2", 0.999))
        eps = float(options.get("eps", 1e-8))
        wd = float(options.get("weight_decay", 0.0))
        p32 = as_f32(params)
        g = as_f32(grads)
        if wd and not self.decoupled:
            g = torch._foreach_add(g, p32, alpha=wd)
        # m = beta1 * m + (1 - beta1) * g, written as a lerp like torch.optim.Adam.
        m = torch._foreach_lerp(list(states["m"]), g, 1 - beta1)
        v = torch._foreach_mul(list(states["v"]), beta2)
        torch._foreach_addcmul_(v, g, g, value=1 - beta2)
        bias1 = 1 - beta1**count
        bias2 = 1 - beta2**count
        step_size = lr / bias1
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, math.sqrt(bias2))
        torch._foreach_add_(denom, eps)
        if wd and self.decoupled:
            # Decoupled decay first, as torch.optim.AdamW does, on the decaying
            # parameters only (times 1.0, bit for bit unchanged, for the others);
            # the product is a fresh tensor, so the step can go into it in place.
            shrink = f32_scalar(1 - lr * wd)
            new = torch._foreach_mul(p32, [shrink if d else 1.0 for d in decay])
            torch._foreach_addcdiv_(new, m, denom, value=f32_scalar(-step_size))
        else:
            new = torch._foreach_addcdiv(p32, m, denom, value=f32_scalar(-step_size))
        return back_to(new, params), {"m": m, "v": v}


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter)."""

    decoupled = True


UPDATES: dict[str, Callable[[], OptimizerUpdate]] = {"sgd": SGD, "adam": Adam, "adamw": AdamW}
"""The built-in updates by optimizer name."""


class StandIn:
    """An :class:`sexpgpu.extension.OptimizerUpdate` standing in for ``update`` (an
    optimizer's own): its states, its ``elementwise``, and its ``propose`` unless
    ``form`` (the stand-in's way of computing a built-in update) is given, which
    :meth:`propose_by_form` then runs. The compiled strategy's updates are these
    (:mod:`sexpgpu_torch.fused_optim`, :mod:`sexpgpu_torch.compiled_optim`)."""

    def __init__(self, update: Any, form: Any) -> None:
        self.update = update
        self.elementwise = update.elementwise  # slices update alike as the eager one does
        self.form = form

    def init_states(self, params: Sequence[Tensor], options: Mapping[str, Any]) -> dict:
        """The stood-in update's fresh states."""
        return self.update.init_states(params, options)

    def propose(self, params, grads, states, *, lr, count, options, decay):  # noqa: ANN001
        """New parameters and states by :meth:`propose_by_form`, or, with no form (a
        plugin's update), by the update's own ``propose``."""
        if self.form is None:
            return self.update.propose(
                params, grads, states, lr=lr, count=count, options=options, decay=decay
            )
        return self.propose_by_form(
            list(params), list(grads), states, lr=lr, count=count, options=options, decay=decay
        )

    def propose_by_form(self, params, grads, states, *, lr, count, options, decay):  # noqa: ANN001
        """``propose`` through ``form``: the subclass's."""
        raise NotImplementedError


def clip_by_global_norm(
    grads: list[Tensor],
    max_norm: float,
    norm_sq: Callable[[Sequence[Tensor]], Tensor] | None = None,
) -> None:
    """Scale ``grads`` in place so their global L2 norm is at most ``max_norm``,
    as torch.nn.utils.clip_grad_norm_ does, without a host sync. ``norm_sq``, when
    given, says the squared norm of the whole gradients of which ``grads`` are a
    part (the slices of ``:shard full``)."""
    if not grads:
        return
    if norm_sq is not None:
        total = norm_sq(grads).sqrt()
    else:
        norms = torch._foreach_norm(grads, 2.0)
        total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef)
