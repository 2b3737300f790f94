"""The torch trainer as one rank of several: how its parameters, gradients and
optimizer states live across the ranks, by the recorded choice ``shard``.

- ``none``: every rank holds everything; DDP averages the gradients
  (:mod:`sexpgpu_torch.replicated`);
- ``optimizer``: as ``none``, but each parameter's states and update belong to one
  rank (:mod:`sexpgpu_torch.shards`);
- ``full``: each rank holds a slice of every parameter, gradient and state (FSDP2,
  :mod:`sexpgpu_torch.fully_sharded`).

:class:`RankedTraining` is a part of :class:`sexpgpu_torch.trainer.TorchTrainer`,
kept here so the trainer reads as one device's steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from sexpgpu.choices import SHARD_CHOICE
from sexpgpu.errors import PluginError
from sexpgpu.lang.ir import Program
from sexpgpu_torch.fully_sharded import FullyShardedTrainable, plan_units, rows_of
from sexpgpu_torch.replicated import Replicated
from sexpgpu_torch.rng import derive_seed
from sexpgpu_torch.shards import OwnedStates

Tensor = torch.Tensor

__all__ = ["RankedTraining"]


class RankedTraining:
    """The trainer's side that knows the ranks (see the module docstring)."""

    program: Program
    shard: str
    device: torch.device
    ctx: Any
    choices: dict[str, str]
    trainable: list[str]
    params: dict[str, Tensor]
    states: dict[str, list[Tensor]]
    ranks: Any = None  # the TorchGroup of a data-parallel run (use_group)
    replica: Replicated | None = None  # its DDP replica
    owned: OwnedStates | None = None  # the parameters it updates (:shard optimizer)
    sharded: FullyShardedTrainable | None = None  # its slices (:shard full)
    _alone = False  # warming up: no collective (but :shard full warms up as it runs)

    @property
    def exports_together(self) -> bool:
        """Whether ``export`` is a collective of the ranks: with sharded states it
        gathers each from its owner, or from every rank's slices."""
        return self.owned is not None or self.sharded is not None

    @property
    def holds_replicas(self) -> bool:
        """Whether the ranks each hold the whole model (not under ``:shard full``,
        where each holds its slices: nothing to compare at the end)."""
        return self.sharded is None

    @property
    def evaluates_together(self) -> bool:
        """Whether ``evaluate`` and ``generate`` are collectives: with sharded
        parameters the first call after a step gathers them whole."""
        return self.sharded is not None

    def use_group(self, group: Any) -> None:
        """Train as one rank of ``group`` (a :class:`sexpgpu_torch.distributed.TorchGroup`):
        each step is handed this rank's part of the global batch and averages the
        gradients across the ranks (DDP); with ``shard`` ``optimizer`` it updates
        only the parameters it owns (:mod:`sexpgpu_torch.shards`), with ``full`` its
        slices of every one (FSDP2, :mod:`sexpgpu_torch.fully_sharded`). Dropout
        draws from a seed of its own per rank, so the ranks' masks are not the same
        for their different records."""
        self.ranks = group
        self.choices[SHARD_CHOICE] = self.shard  # one device has nothing to shard
        # a stage's generator: each rank makes its part of the records (an eval pass's
        # generates whole batches, each on the rank that evaluates them)
        self._shared_generators = frozenset(
            s.generator.name for s in self.program.stages if s.generator is not None
        )
        if self.shard == "full":
            self._shard_fully(group)
        else:
            self.replica = Replicated(group, self.device)
        if self.shard == "optimizer":
            sizes = [math.prod(self._decl_by_path[p].type.shape) for p in self.trainable]
            self.owned = OwnedStates(group, sizes)
        self.ctx.seed = derive_seed(self.program.run.seed, "rank", group.rank)

    def _shard_fully(self, group: Any) -> None:
        """``:shard full``: FSDP2 units planned from the program's repeats, every graph
        compiled again with no repeat inlined (each iteration runs through its unit)."""
        for info, (update, _) in zip(self.optimizer_infos, self.updates, strict=True):
            if not getattr(getattr(update, "update", update), "elementwise", False):
                raise PluginError(
                    f"the optimizer '{info.name}' cannot update slices of parameters "
                    "(shard full): its update does not say elementwise = True; "
                    "shard none or optimizer"
                )
        self.sharded = FullyShardedTrainable(group, self.device, self.ctx)
        self._units = plan_units(self.program, self.trainable)
        self._compile_graphs(frozenset())

    def _slice(self, tensor: Tensor) -> Tensor:
        """This rank's slice of a whole state once the parameters are sharded."""
        if self.sharded is not None and self.sharded.attached:
            return rows_of(tensor, self.ranks.rank, self.ranks.size)
        return tensor

    def _hold_whole(self) -> None:
        """Every parameter whole in ``ctx.params`` until the next step: under ``:shard
        full`` gathered at the first call after a step (a collective every rank enters:
        its first eval batch or generation)."""
        if self.sharded is not None and self.sharded.attached and not self.sharded.holding:
            self.sharded.hold_whole()

    def _let_go(self) -> None:
        """Back to the slices alone (a step runs through FSDP2's units)."""
        if self.sharded is not None:
            self.sharded.let_go()

    def _trainable_tensors(self) -> list[Tensor]:
        """Each trainable parameter, or this rank's slice of it (``:shard full``)."""
        if self.sharded is not None and self.sharded.attached:
            return [self.sharded.local(p) for p in self.trainable]
        return [self.params[p] for p in self.trainable]

    def _norm_sq(self) -> Any:
        """How clipping takes the squared norm of the gradients (``None``: its own)."""
        if self.sharded is not None and self.sharded.attached:
            return self.sharded.global_norm_sq
        return None

    def _mine(self, values: Sequence[Any]) -> list[Any]:
        """The entries of ``values`` (one per trainable parameter) this rank updates."""
        if self.owned is None:
            return list(values)
        return [values[i] for i in self.owned.mine]

    def _state_position(self, index: int) -> int | None:
        """Where trainable parameter ``index``'s states are in this rank's lists
        (``None``: another rank keeps them)."""
        if self.owned is None:
            return index
        return self.owned.position.get(index)

    def _replicated_loss_and_grads(self, stage: int) -> tuple[Tensor, list[Tensor]]:
        """As ``_loss_and_grads``, for the global batch: the ranks' mean loss and
        the gradients DDP averaged (before clipping: the norm is the global batch's)."""
        assert self.replica is not None
        if not self.replica.attached:
            self.replica.attach(self.params, self.trainable)
        return self.replica.loss_and_grads(partial(self._stage_loss, stage))

    def _sharded_loss_and_grads(self, stage: int) -> tuple[Tensor, list[Tensor]]:
        """As ``_replicated_loss_and_grads``, with this rank's slices of the gradients."""
        assert self.sharded is not None
        if not self.sharded.attached:
            self.sharded.attach(self.params, *self._units)
            rank, size = self.ranks.rank, self.ranks.size
            self.states = {
                name: [rows_of(t, rank, size) for t in values]
                for name, values in self.states.items()
            }
        return self.sharded.loss_and_grads(partial(self._stage_loss, stage), self.trainable)
