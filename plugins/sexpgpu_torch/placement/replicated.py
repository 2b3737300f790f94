"""Replicated training (``:shard none``) on torch's ``DistributedDataParallel``.

Every rank holds every parameter and optimizer state; a step's gradients are
averaged by DDP's bucketed all-reduce, each bucket sent while the backward pass
still computes the ones before it. :class:`Replicated` is the placement,
:class:`DdpReplica` its DDP module.

DDP wants a module whose parameters are the leaves the loss is differentiated
by, while the trainer's graphs read plain tensors from ``ctx.params``. So the
trainable tensors are wrapped once in :class:`nn.Parameter` objects held by
:class:`_Holder`, and ``ctx.params`` holds a view of each (a plain tensor, as the
graphs were traced and compiled with: a compiled graph guards on the type), so
gradients flow through the view to the parameter, where DDP's hooks are. A
committed step swaps each parameter's storage (``.data``) for the proposal's
tensor, so the module and DDP's hooks stay the same objects for the whole run.

The buckets are DDP's first ones, in reverse parameter order (about the order
the backward pass makes gradients), and are never rebuilt from a step's
observed order (``find_unused_parameters`` keeps them, and lets a stage's loss
leave some parameters out): the same program lays its gradients out the same
way in every process, so a resumed run sums them in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sexpgpu_torch.placement.base import Model, Placement, States
from sexpgpu_torch.placement.single import Single

if TYPE_CHECKING:
    from sexpgpu_torch.distributed import TorchGroup

Tensor = torch.Tensor

__all__ = ["DdpReplica", "Replicated"]


class _Holder(nn.Module):
    """The trainable parameters as one module; its forward runs a stage's loss."""

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        super().__init__()
        for index, t in enumerate(tensors):
            self.register_parameter(f"p{index}", nn.Parameter(t.detach(), requires_grad=True))
        # Never used by a loss: DDP, told to look for unused parameters, warns on
        # every rank's stderr when it finds none (its one element costs nothing).
        self.unused = nn.Parameter(torch.zeros(1, device=tensors[0].device if tensors else None))

    def forward(self, run: Callable[[], Tensor]) -> Tensor:
        return run()


class DdpReplica:
    """One rank's replica under DDP (see the module docstring).

    ``group`` is the plugin's :class:`~sexpgpu_torch.distributed.TorchGroup`: its
    collectives name a lost peer with ``E-DP-003``.
    """

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.device = device
        self._ddp: DistributedDataParallel | None = None
        self._params: list[nn.Parameter] = []
        self._index: dict[str, int] = {}

    @property
    def attached(self) -> bool:
        """Whether the replica holds the parameters (from the first step on)."""
        return self._ddp is not None

    def attach(self, params: MutableMapping[str, Tensor], trainable: Sequence[str]) -> None:
        """Wrap ``trainable``'s tensors of ``params`` (set already, the same on every
        rank) and put views of them in their place."""
        holder = _Holder([params[path] for path in trainable])
        self._params = [getattr(holder, f"p{i}") for i in range(len(trainable))]
        self._index = {path: i for i, path in enumerate(trainable)}
        on_cuda = self.device.type == "cuda"
        self._ddp = self.group.call(
            "wrapping the model",
            lambda: DistributedDataParallel(
                holder,
                device_ids=[self.device.index] if on_cuda else None,
                init_sync=False,  # the ranks start equal; the end compares them (E-DP-003)
                find_unused_parameters=True,
                gradient_as_bucket_view=True,  # the averaged gradients are the buckets: no copy
            ),
        )
        for path in trainable:
            params[path] = self.view(path)
        self.group.on_close(self.release)

    def release(self) -> None:
        """Let go of DDP (and through it the process group), as the group closes."""
        self._ddp = None

    def view(self, path: str) -> Tensor:
        """A plain tensor aliasing the parameter of ``path``, gradients flowing through."""
        p = self._params[self._index[path]]
        with torch.enable_grad():
            return p.view_as(p)

    def take(self, path: str, value: Tensor) -> Tensor:
        """Make ``value`` the parameter of ``path`` (in place: the same object) and
        return its new view."""
        self._params[self._index[path]].data = value.detach()
        return self.view(path)

    def holds(self, path: str) -> bool:
        """Whether ``path`` is one of the replica's parameters."""
        return self.attached and path in self._index

    def loss_and_grads(self, run: Callable[[], Tensor]) -> tuple[Tensor, list[Tensor]]:
        """The mean of every rank's loss and the averaged gradient of each parameter
        (zeros where the loss does not reach one), from ``run``, which computes this
        rank's loss from ``ctx.params``."""
        assert self._ddp is not None
        loss = self._ddp(run)  # this rank's forward: an error in it is its own, not the group's
        mean = self.group.backward(loss, "averaging gradients")
        grads = []
        for p in self._params:
            grad = p.grad
            p.grad = None  # the next step's backward starts from nothing
            grads.append(grad if grad is not None else torch.zeros_like(p))
        return mean, grads

    def commit(self, params: MutableMapping[str, Tensor], values: Mapping[str, Tensor]) -> None:
        """Make each of ``values`` (by path) its parameter's storage and refresh the
        views in ``params``."""
        for path, value in values.items():
            params[path] = self.take(path, value)


class Replicated(Single):
    """The placement of ``:shard none``: every tensor whole on every rank, the
    gradients averaged by DDP (:class:`DdpReplica`), which wraps the trainable
    parameters at the first step."""

    def __init__(self, model: Model, group: TorchGroup) -> None:
        super().__init__(model)
        self.replica = DdpReplica(group, model.device)

    def warm_up_placement(self) -> Placement:
        """This rank alone: the warm-up's stand-ins are no step of the run, and DDP's
        exchange would wait on ranks running other graphs."""
        return Single(self.model)

    def set_param(self, path: str, value: Tensor, *, trainable: bool) -> None:
        """A trainable parameter DDP wraps takes ``value`` in place (the same
        ``nn.Parameter``, its hooks kept); any other, as one device does."""
        if self.replica.holds(path):
            self.model.tensors[path] = self.replica.take(path, value)
        else:
            super().set_param(path, value, trainable=trainable)

    def attach(self, states: States) -> States:
        """At the first step, DDP wraps the trainable parameters (set already, the
        same on every rank)."""
        if not self.replica.attached:
            self.replica.attach(self.model.tensors, self.model.trainable)
        return states

    def loss_and_grads(self, stage_loss: Callable[[], Tensor]) -> tuple[Tensor, list[Tensor]]:
        """The ranks' mean loss and the gradients DDP averaged (before clipping: the
        norm is the global batch's)."""
        return self.replica.loss_and_grads(stage_loss)

    def commit(self, new_params: list[Tensor]) -> list[Tensor]:
        """The new tensors become the storage of DDP's parameters."""
        if not self.replica.attached:  # no step has wrapped them
            return super().commit(new_params)
        self.replica.commit(
            self.model.tensors, dict(zip(self.model.trainable, new_params, strict=True))
        )
        return new_params
