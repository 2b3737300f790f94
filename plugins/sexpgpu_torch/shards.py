"""What the devices of a run shard (the recorded choice ``shard``), and the sharded
optimizer states of ``:shard optimizer``.

- ``none``: every rank holds every parameter and optimizer state (DDP,
  :mod:`sexpgpu_torch.replicated`);
- ``optimizer``: gradients are averaged by DDP as with ``none``, but each parameter
  is *owned* by one rank, which alone keeps its optimizer states and computes its
  update; the owners then broadcast the new values, so every rank commits the
  same parameters (ZeRO stage 1). Ownership is whole parameters, handed out
  largest first to the rank holding the fewest elements so far (torch's
  ``ZeroRedundancyOptimizer`` does the same), so any optimizer works, and the
  split depends on the program and the rank count alone;
- ``full``: parameters, gradients and states sharded by FSDP2.

A checkpoint holds every state whatever the choice: exporting gathers each state
from its owner (a collective, so every rank exports at the writer's checkpoints).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from sexpgpu.choices import SHARD_CHOICE, Choices, cannot_take
from sexpgpu.lang.ir import SHARDINGS, Program

Tensor = torch.Tensor

__all__ = ["OwnedStates", "take_shard"]


def take_shard(program: Program, choices: Choices) -> str:
    """The run's sharding (see the module docstring): asked for or pinned, else the
    program's ``:shard``, else ``none``."""
    shard = choices.pin(SHARD_CHOICE) or program.run.shard or "none"
    if shard not in SHARDINGS:
        raise cannot_take(SHARD_CHOICE, shard, "the torch lowering shards none, optimizer or full")
    return shard


def owners(sizes: Sequence[int], ranks: int) -> list[int]:
    """The rank that owns each of parameters of ``sizes`` elements: largest first, to
    the rank with the fewest elements so far (the lowest such rank on a tie); equal
    sizes keep their order."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += sizes[index]
    return owner


class OwnedStates:
    """This rank's part of ``:shard optimizer``: which parameters it updates, and the
    exchange of every rank's new values (one broadcast per rank and dtype).

    ``group`` is the plugin's :class:`~sexpgpu_torch.distributed.TorchGroup`.
    """

    def __init__(self, group: Any, sizes: Sequence[int]) -> None:
        self.group = group
        self.rank: int = group.rank
        self.owner = owners(sizes, group.size)
        self.mine = [i for i, r in enumerate(self.owner) if r == self.rank]
        """The indices (of the trainable parameters) this rank updates, in order."""
        self.position = {index: k for k, index in enumerate(self.mine)}
        """Where each of :attr:`mine` is in this rank's lists (its states, its updates)."""

    def share(self, mine: Sequence[Tensor], like: Sequence[Tensor]) -> list[Tensor]:
        """Every trainable parameter's new value: ``mine`` (this rank's, in the order of
        :attr:`mine`) and the other ranks' from their owners; ``like`` (the current
        values) gives each one's shape, dtype and device."""
        new: list[Tensor | None] = [None] * len(like)
        for index, value in zip(self.mine, mine, strict=True):
            new[index] = value
        for rank in range(self.group.size):
            by_dtype: dict[torch.dtype, list[int]] = {}
            for index, owner in enumerate(self.owner):
                if owner == rank:
                    by_dtype.setdefault(like[index].dtype, []).append(index)
            for dtype, indices in by_dtype.items():
                self._broadcast(rank, dtype, indices, new, like)
        return new  # type: ignore[return-value]

    def _broadcast(
        self,
        rank: int,
        dtype: torch.dtype,
        indices: list[int],
        new: list[Tensor | None],
        like: Sequence[Tensor],
    ) -> None:
        if rank == self.rank:
            flat = torch.cat([new[i].reshape(-1) for i in indices])  # type: ignore[union-attr]
        else:
            count = sum(like[i].numel() for i in indices)
            flat = torch.empty(count, dtype=dtype, device=like[indices[0]].device)
        self.group.call("sharing the updated parameters", lambda: dist.broadcast(flat, src=rank))
        if rank == self.rank:
            return
        for i, piece in zip(indices, flat.split([like[i].numel() for i in indices]), strict=True):
            new[i] = piece.view_as(like[i])

    def gather_states(
        self, states: Mapping[str, Sequence[Tensor]], like: Sequence[Tensor]
    ) -> dict[tuple[int, str], Tensor]:
        """Every state of every trainable parameter, by (index, name), on every rank:
        ``states`` holds this rank's, a list per name in the order of :attr:`mine`;
        ``like`` the parameters, for shapes. One broadcast per owner (states are f32)."""
        names = list(states)
        whole: dict[tuple[int, str], Tensor] = {}
        for rank in range(self.group.size):
            owned = [i for i, r in enumerate(self.owner) if r == rank]
            keys = [(i, name) for i in owned for name in names]
            if not keys:
                continue
            if rank == self.rank:
                flat = torch.cat([states[name][self.position[i]].reshape(-1) for i, name in keys])
            else:
                count = sum(like[i].numel() for i, _ in keys)
                flat = torch.empty(count, dtype=torch.float32, device=like[owned[0]].device)
            self.group.call(
                "gathering the optimizer states",
                lambda flat=flat, rank=rank: dist.broadcast(flat, src=rank),
            )
            pieces = flat.split([like[i].numel() for i, _ in keys])
            for (i, name), piece in zip(keys, pieces, strict=True):
                whole[i, name] = piece.view(like[i].shape)
        return whole
