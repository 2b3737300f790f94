"""One device holds everything: every parameter whole, its gradient, every state.

The placement of a run alone, of every trainer until ``use_group`` places it among
ranks, and of the warm-up of replicas (which compiles their graphs with no other
rank waiting). The other placements build on it for what they hold whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sexpgpu_torch.placement.base import (
    Exported,
    HostCopies,
    Model,
    Placement,
    States,
    keyed_states,
)

Tensor = torch.Tensor

__all__ = ["Single"]


class Single(Placement):
    """Every tensor whole on this device (see the module docstring)."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def set_param(self, path: str, value: Tensor, *, trainable: bool) -> None:
        """``value`` itself, differentiated by when trainable."""
        if trainable:
            value.requires_grad_(True)
        self.model.tensors[path] = value

    def attach(self, states: States) -> States:
        """Nothing to hold otherwise: the states as they are."""
        return states

    def loss_and_grads(self, stage_loss: Callable[[], Tensor]) -> tuple[Tensor, list[Tensor]]:
        """This device's loss and its gradients, by ``torch.autograd.grad``."""
        trainable = self.trainable_tensors()
        loss = stage_loss()
        if trainable and loss.requires_grad:
            grads = list(torch.autograd.grad(loss, trainable, allow_unused=True))
        else:  # a loss that reaches no trainable parameter
            grads = [None] * len(trainable)
        return loss.detach(), [
            torch.zeros_like(t) if g is None else g for t, g in zip(trainable, grads, strict=True)
        ]

    def trainable_tensors(self) -> list[Tensor]:
        """The trainable parameters, whole."""
        return [self.model.tensors[path] for path in self.model.trainable]

    def commit(self, new_params: list[Tensor]) -> list[Tensor]:
        """The new tensors become the parameters."""
        for path, t in zip(self.model.trainable, new_params, strict=True):
            self.model.tensors[path] = t.requires_grad_(True)
        return new_params

    def export(self, states: States, copies: HostCopies, *, reuse: bool) -> Exported:
        """The parameters and states this device holds, copied out."""
        params = {path: self.model.tensors[path] for path in self.model.kept()}
        whole = keyed_states(self.model.trainable, list(states), lambda i, n: states[n][i])
        return copies.copy(params, reuse=reuse), copies.copy(whole, reuse=reuse)
