"""How the torch trainer runs its graphs: the strategy it is built with.

One trainer (:class:`sexpgpu_torch.trainer.TorchTrainer`) serves both lowerings of
this plugin. It compiles every graph of a program into a
straight-line function (:mod:`sexpgpu_torch.graphs`) and keeps parameters, states and checkpoints; its
:class:`Strategy` decides how those functions and the optimizer updates are run,
and what follows from that (when the graphs compile, how a loss comes to the host,
how a checkpoint's tensors are copied out). :class:`Eager` runs them as they are
(the ``torch`` lowering); :class:`sexpgpu_torch.compiled.Compiled` wraps the same
functions with ``torch.compile`` (the ``compiled`` lowering).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from sexpgpu.extension import OptimizerUpdate
from sexpgpu_torch.graphs import Ctx

if TYPE_CHECKING:
    from sexpgpu_torch.trainer import Proposal

Tensor = torch.Tensor
GraphFn = Callable[[], list[Tensor]]
"""A compiled graph: runs on the context's parameters and inputs, returns its outputs."""


class Strategy(Protocol):
    """How the torch trainer runs its graphs (see the module docstring)."""

    reads_loss_late: bool
    """The trainer's ``reads_loss_late``: whether reading a step's loss waits for the
    device, so the run reads it once the next step is queued."""

    fixed_shapes: bool
    """Whether each graph should see the same shapes at every call (a compiler's
    does: a new shape compiles again); a generator's cache is then read whole, its
    later positions masked, rather than up to the last position written."""

    def context(self, seed: int, device: torch.device) -> Ctx:
        """What the trainer's graphs will read besides their values."""

    def autocasts(self, precision: str, device: torch.device) -> bool:
        """Whether a program of ``precision`` runs its graphs under bf16 autocast."""

    def stage_loss(self, graph: GraphFn, ctx: Ctx) -> GraphFn:
        """How a stage's loss graph (over ``ctx``) is run; its backward follows it."""

    def update(self, update: OptimizerUpdate, *, overwrites: bool) -> OptimizerUpdate:
        """How an optimizer's update is run; ``overwrites``: the trainer reads neither its
        inputs nor anything but what it proposes again (no finite guard, and a
        placement that commits the tensors it is given), so a kernel may write into
        them instead of into copies."""

    def evaluation(self, graph: GraphFn) -> GraphFn:
        """How an eval pass's graph is run."""

    def warm_up(self, run_every_graph: Callable[[], None], device: torch.device) -> float | None:
        """Compile what ``run_every_graph`` (one call of each graph on stand-ins) runs,
        now; the seconds it took, or ``None`` when nothing compiles."""

    def watching(self) -> AbstractContextManager[None]:
        """A stretch of eval-pass calls (a generation's trips) in which a graph that
        compiles again is said once, as at any call, at no cost per call."""

    def read_flag(self, found: Tensor, proposal: Proposal) -> bool:
        """Whether the finite guard's ``found`` flag (on the device) is up."""

    def copy_to_host(self, arrays: Mapping[str, np.ndarray], tensors: Mapping[str, Tensor]) -> None:
        """Copy each of ``tensors`` into the host array of its name; done on return."""


def copy_plainly(arrays: Mapping[str, np.ndarray], tensors: Mapping[str, Tensor]) -> None:
    """Copy each of ``tensors`` into the host array of its name (``bf16`` as ``f32``)."""
    for name, t in tensors.items():
        torch.from_numpy(arrays[name]).copy_(t.detach())


class Eager:
    """The ``torch`` lowering's strategy: every graph and update run as PyTorch executes
    it, op by op; nothing to compile, and a loss is on the host when read."""

    reads_loss_late = False
    fixed_shapes = False

    def context(self, seed: int, device: torch.device) -> Ctx:
        """The plain context: dropout draws its masks as it runs."""
        return Ctx(seed, device)

    def autocasts(self, precision: str, device: torch.device) -> bool:
        """bf16 autocast on CUDA only: on the CPU the eager lowering computes in the
        parameters' own dtypes."""
        return precision == "bf16" and device.type == "cuda"

    def stage_loss(self, graph: GraphFn, ctx: Ctx) -> GraphFn:
        """The graph as it is."""
        return graph

    def update(self, update: OptimizerUpdate, *, overwrites: bool) -> OptimizerUpdate:
        """The update as it is."""
        return update

    def evaluation(self, graph: GraphFn) -> GraphFn:
        """The graph as it is."""
        return graph

    def warm_up(self, run_every_graph: Callable[[], None], device: torch.device) -> None:
        """Nothing compiles: nothing is run."""
        return None

    def watching(self) -> AbstractContextManager[None]:
        """Nothing compiles: nothing to watch."""
        return nullcontext()

    def read_flag(self, found: Tensor, proposal: Proposal) -> bool:
        """The flag alone (one host sync); the loss is read when asked for."""
        return bool(float(found))

    def copy_to_host(self, arrays: Mapping[str, np.ndarray], tensors: Mapping[str, Tensor]) -> None:
        """A plain copy, tensor by tensor."""
        copy_plainly(arrays, tensors)
