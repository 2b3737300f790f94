"""The placement protocol: where a trainer's parameters, gradients and optimizer states
sit, and what follows from that at each step, checkpoint and eval pass.

:class:`~sexpgpu_torch.trainer.TorchTrainer` asks its :class:`Placement` and never
which one it has (see :mod:`sexpgpu_torch.placement` for the four). A placement works
on the trainer's :class:`Model`: the parameters by path, in the very dict the graphs
read, which it fills with what the graphs should see (whole tensors, DDP's views, or
nothing while FSDP2 holds slices).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import torch

from sexpgpu.extension import OptimizerInfo, OptimizerUpdate
from sexpgpu.lang.ir import ParamDecl, Program
from sexpgpu_torch.graphs import Ctx

Tensor = torch.Tensor
States = dict[str, list[Tensor]]
"""Optimizer states by name: one tensor per trainable parameter this rank updates."""
Exported = tuple[dict[str, np.ndarray], dict[str, np.ndarray]]
"""Host copies of (parameters by path, states by ``path/state``), as ``export`` gives."""
NormSq = Callable[[Sequence[Tensor]], Tensor]
"""The squared L2 norm of the whole gradients of which some tensors are a part."""
_T = TypeVar("_T")

__all__ = ["Exported", "HostCopies", "Model", "NormSq", "Placement", "States", "keyed_states"]


@dataclass(frozen=True)
class Model:
    """A trainer's parameters as its placement works on them."""

    program: Program
    decls: Mapping[str, ParamDecl]
    """Every parameter's declaration by path, in declaration order."""
    trainable: Sequence[str]
    """The trainable parameters' paths, in declaration order: every list a step makes
    (gradients, proposed values, each state's tensors) follows it."""
    tensors: dict[str, Tensor]
    """The parameters by path, as the graphs read them (the context's own dict)."""
    ctx: Ctx
    device: torch.device

    def kept(self) -> list[str]:
        """The paths a checkpoint holds: every parameter but a frozen ``:load`` one,
        which experiment.json names rather than copies."""
        return [path for path, d in self.decls.items() if d.trainable or d.load is None]


class HostCopies:
    """Where ``export`` puts its host copies: arrays already laid out as the
    safetensors files a checkpoint writes (``layout_tensors``), so writing them copies
    nothing more; the tensors go in through the strategy's ``copy_to_host``."""

    def __init__(
        self, copy_to_host: Callable[[Mapping[str, np.ndarray], Mapping[str, Tensor]], None]
    ):
        self.copy_to_host = copy_to_host
        self._kept: dict[tuple, dict[str, np.ndarray]] = {}

    @staticmethod
    def layout(specs: Mapping[str, tuple[tuple[int, ...], str]]) -> dict[str, np.ndarray]:
        """Fresh arrays of ``specs`` (name: shape, dtype name) in the files' layout."""
        from sexpgpu.checkpoint import layout_tensors

        return layout_tensors(specs)

    def copy(self, tensors: Mapping[str, Tensor], *, reuse: bool) -> dict[str, np.ndarray]:
        """Host copies of ``tensors`` (floats as f32). With ``reuse`` the arrays of the
        previous copy of the same layout are overwritten and handed back (fresh pages
        would cost page faults on every checkpoint); the caller is done with them."""
        specs = {
            name: (
                tuple(t.shape),
                "float32" if t.is_floating_point() else str(t.dtype).removeprefix("torch."),
            )
            for name, t in tensors.items()
        }
        key = tuple(specs.items())
        arrays = self._kept.get(key) if reuse else None
        if arrays is None:
            arrays = self.layout(specs)
            self._kept[key] = arrays
        self.copy_to_host(arrays, tensors)
        return arrays


class Placement(Protocol):
    """Where one rank's parameters, gradients and optimizer states sit.

    ``set_param``, ``attach``, ``loss_and_grads``, ``trainable_tensors``, ``commit``
    and ``export`` are every placement's own; the other members are declared here
    with the defaults of a placement that holds every tensor whole and computes
    alone, which a placement inherits by subclassing this protocol.
    """

    exports_together: bool = False
    """The trainer's ``exports_together``: whether ``export`` is a collective."""

    holds_replicas: bool = True
    """The trainer's ``holds_replicas``: whether each rank holds the whole model."""

    evaluates_together: bool = False
    """The trainer's ``evaluates_together``: whether the first ``hold_whole`` after a
    step (an eval pass's or a generator's) is a collective."""

    # -- every placement's own

    def set_param(self, path: str, value: Tensor, *, trainable: bool) -> None:
        """Make ``value`` (whole, on the device, in its dtype) the parameter at ``path``."""
        ...

    def attach(self, states: States) -> States:
        """Before a step's passes: hold the parameters as a step needs them (from the
        first step on), and return ``states`` as this placement keeps them."""
        ...

    def loss_and_grads(self, stage_loss: Callable[[], Tensor]) -> tuple[Tensor, list[Tensor]]:
        """The step's loss (over the ranks, their mean) from ``stage_loss``, which
        computes this rank's from the graphs' parameters, and a gradient for each
        tensor of :meth:`trainable_tensors` (zeros for one the loss does not reach)."""
        ...

    def trainable_tensors(self) -> list[Tensor]:
        """Each trainable parameter as this rank holds it (whole, or its slice)."""
        ...

    def commit(self, new_params: list[Tensor]) -> list[Tensor]:
        """Make ``new_params`` (one per trainable parameter, as :meth:`trainable_tensors`)
        the parameters; what the committed proposal keeps of them."""
        ...

    def export(self, states: States, copies: HostCopies, *, reuse: bool) -> Exported:
        """Host copies of the parameters a checkpoint holds and of every state, whole,
        made in ``copies`` (``reuse``: see :meth:`HostCopies.copy`)."""
        ...

    # -- declared, with defaults

    def warm_up_placement(self) -> Placement:
        """The placement the warm-up runs every graph on (stand-ins, no other rank
        waiting): this one by default."""
        return self

    def check_optimizers(self, optimizers: Sequence[tuple[OptimizerInfo, OptimizerUpdate]]) -> None:
        """Refuse (``PluginError``) a stage's optimizer this placement cannot update
        with; every one by default."""

    def inline_sites(self, sites: frozenset[str]) -> frozenset[str]:
        """Of ``sites``, those whose repeats the graphs may emit iteration by
        iteration here: all by default."""
        return sites

    def clip_norm_sq(self) -> NormSq | None:
        """How clipping takes the squared norm of the gradients; ``None``: from the
        tensors it is given, which are whole."""
        return None

    def mine(self, values: Sequence[_T]) -> list[_T]:
        """The entries of ``values`` (one per trainable parameter) this rank updates:
        every one by default."""
        return list(values)

    def state_position(self, index: int) -> int | None:
        """Where trainable parameter ``index``'s states are in this rank's lists
        (``None``: another rank keeps them)."""
        return index

    def share(self, new_params: list[Tensor], like: Sequence[Tensor]) -> list[Tensor]:
        """Every trainable parameter's new value: this rank's ``new_params`` (those of
        :meth:`mine`) and the others', sent by the ranks that made them; ``like`` gives
        their shapes and dtypes. By default ``new_params`` are every one already."""
        return new_params

    def slice_state(self, whole: Tensor) -> Tensor:
        """This rank's part of a whole state read from a checkpoint."""
        return whole

    def hold_whole(self) -> None:
        """Every parameter whole for the graphs until :meth:`let_go` (an eval pass,
        a generator): they are by default."""

    def let_go(self) -> None:
        """Back to the parameters as steps hold them, after :meth:`hold_whole`."""


def keyed_states(
    trainable: Sequence[str], names: Sequence[str], whole: Callable[[int, str], _T]
) -> dict[str, _T]:
    """``whole(index, name)`` by ``path/name``: parameter by parameter, each one's
    states in the order of ``names`` (the order of a checkpoint's states file)."""
    return {f"{path}/{name}": whole(i, name) for i, path in enumerate(trainable) for name in names}
