"""Where a trainer's tensors sit: one placement per way, the recorded choice ``shard``.

:class:`~sexpgpu_torch.trainer.TorchTrainer` runs every step, checkpoint and eval
pass through its :class:`Placement` (:mod:`.base`), which owns what differs between
them: setting a parameter, the loss and its gradients, which tensors this rank
updates, committing and exporting them, and holding the parameters whole for a pass.

- :mod:`.single`: one device holds everything (a run alone; every trainer until it
  is placed among ranks);
- :mod:`.replicated` (``:shard none``): every rank holds everything, DDP averages the
  gradients;
- :mod:`.owned` (``:shard optimizer``): as ``none``, but each parameter's states and
  update belong to one rank, which shares the new values (ZeRO stage 1);
- :mod:`.fully_sharded` (``:shard full``): each rank holds a slice of every
  parameter, gradient and state (FSDP2).

The engines are torch's own (``DistributedDataParallel``, ``fully_shard``); each
module wraps its engine for the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sexpgpu.choices import SHARD_CHOICE, Choices, cannot_take
from sexpgpu.lang.ir import SHARDINGS, Program
from sexpgpu_torch.placement.base import HostCopies, Model, Placement
from sexpgpu_torch.placement.fully_sharded import FullySharded
from sexpgpu_torch.placement.owned import Owned
from sexpgpu_torch.placement.replicated import Replicated
from sexpgpu_torch.placement.single import Single

if TYPE_CHECKING:
    from sexpgpu_torch.distributed import TorchGroup

__all__ = ["BY_SHARD", "HostCopies", "Model", "Placement", "Single", "placement_for", "take_shard"]

BY_SHARD: dict[str, Callable[[Model, TorchGroup], Placement]] = {
    "none": Replicated,
    "optimizer": Owned,
    "full": FullySharded,
}
"""The placement of each value of the choice ``shard`` on several ranks."""


def take_shard(program: Program, choices: Choices) -> str:
    """The run's sharding: asked for or pinned, else the program's ``:shard``, else
    ``none``."""
    shard = choices.pin(SHARD_CHOICE) or program.run.shard or "none"
    if shard not in SHARDINGS:
        raise cannot_take(SHARD_CHOICE, shard, "the torch lowering shards none, optimizer or full")
    return shard


def placement_for(shard: str, model: Model, group: TorchGroup) -> Placement:
    """The placement of ``model`` as one rank of ``group`` by the choice ``shard``."""
    return BY_SHARD[shard](model, group)
