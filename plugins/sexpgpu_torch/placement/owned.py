"""Owned optimizer states (``:shard optimizer``, ZeRO stage 1).

The gradients are averaged by DDP as under ``none`` (:mod:`.replicated`), but each
trainable parameter is *owned* by one rank, which alone keeps its optimizer states
and computes its update; the owners then broadcast the new values, so every rank
commits the same parameters. Ownership is whole parameters, handed out largest first
to the rank holding the fewest elements so far (torch's ``ZeroRedundancyOptimizer``
does the same), so any optimizer works, and the split depends on the program and the
rank count alone.

A checkpoint holds every state whatever the placement: exporting gathers each state
from its owner (a collective, so every rank exports at the writer's checkpoints).
:class:`Owned` is the placement, :class:`OwnedStates` the ownership and its exchanges.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from sexpgpu_torch.placement.base import (
    Exported,
    HostCopies,
    Model,
    Placement,
    States,
    keyed_states,
)
from sexpgpu_torch.placement.replicated import Replicated
from sexpgpu_torch.placement.single import Single

if TYPE_CHECKING:
    from sexpgpu_torch.distributed import TorchGroup

Tensor = torch.Tensor
_T = TypeVar("_T")

__all__ = ["Owned", "OwnedAlone", "OwnedStates", "owners"]


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

    def pick(self, values: Sequence[_T]) -> list[_T]:
        """The entries of ``values`` (one per trainable parameter) of :attr:`mine`."""
        return [values[i] for i in self.mine]

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


class _OwningSome:
    """What a rank that owns some parameters updates (of :class:`OwnedStates`)."""

    owned: OwnedStates

    def mine(self, values: Sequence[_T]) -> list[_T]:
        """The entries of the parameters this rank owns."""
        return self.owned.pick(values)

    def state_position(self, index: int) -> int | None:
        """Its place among the owned ones; ``None`` for another rank's."""
        return self.owned.position.get(index)


class Owned(_OwningSome, Replicated):
    """The placement of ``:shard optimizer`` (see the module docstring): DDP's
    replicas, each rank updating the parameters it owns."""

    exports_together = True  # every state gathered from its owner

    def __init__(self, model: Model, group: TorchGroup) -> None:
        super().__init__(model, group)
        sizes = [math.prod(model.decls[path].type.shape) for path in model.trainable]
        self.owned = OwnedStates(group, sizes)

    def warm_up_placement(self) -> Placement:
        """This rank alone, still updating only what it owns (the updates compile for
        the tensors the run's steps give them), sharing nothing."""
        return OwnedAlone(self.model, self.owned)

    def share(self, new_params: list[Tensor], like: Sequence[Tensor]) -> list[Tensor]:
        """Every rank's new values from their owners (:meth:`OwnedStates.share`)."""
        return self.owned.share(new_params, like)

    def export(self, states: States, copies: HostCopies, *, reuse: bool) -> Exported:
        """The parameters, and every state gathered from the rank that keeps it."""
        like = self.trainable_tensors()
        gathered = self.owned.gather_states(states, like)
        params = {path: self.model.tensors[path] for path in self.model.kept()}
        whole = keyed_states(self.model.trainable, list(states), lambda i, n: gathered[i, n])
        return copies.copy(params, reuse=reuse), copies.copy(whole, reuse=reuse)


class OwnedAlone(_OwningSome, Single):
    """An owner's warm-up (:meth:`Owned.warm_up_placement`): whole tensors on this
    rank, as one device holds them, but only its own parameters updated."""

    def __init__(self, model: Model, owned: OwnedStates) -> None:
        super().__init__(model)
        self.owned = owned
