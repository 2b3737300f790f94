"""Fully sharded training (``:shard full``) on torch's FSDP2 (``fully_shard``).

Each rank keeps a slice (rows of the first axis, as ``torch.chunk`` cuts them) of
every trainable parameter, of its gradient and of its optimizer states; a whole
parameter exists only while a pass needs it.

FSDP2 works on modules: it gathers a module's parameters before its forward,
frees them after it, gathers them again when the backward pass reaches the
module, and reduce-scatters their gradients once it is through. The trainer's
graphs are no modules, so the trainable tensors are put in modules shaped after
the program (:func:`plan_units`):

- a *unit* per iteration of each repeat in the stage losses (a transformer's
  block): the graph's repeat calls the stack kernel with a body that runs through
  the iteration's unit (``Ctx.units``), so only one block's parameters are whole
  at a time, forward and backward;
- the *root*: every other trainable parameter (embeddings, the head), whole from
  the loss's start to the end of its backward pass; its forward runs the loss.

While a module runs, its whole parameters are put in ``ctx.params`` as plain
views (the graphs read them there, by path, as in any other run). Between steps
``ctx.params`` holds none of them. An eval pass or a generator, which the ranks
may run for different batches and trips, reads every parameter gathered whole
at its first call after a step (:meth:`FullyShardedTrainable.hold_whole`), until
the next step lets go of them.

Each rank updates its own slices with the stage's optimizer, which must compute
each element from the same element of its inputs alone (sgd, adam and adamw do;
a third-party update says so with ``elementwise = True``): the same values, then,
as updating the whole tensors. Clipping takes the global norm over every rank's
slices.

:class:`FullySharded` is the placement, :class:`FullyShardedTrainable` its FSDP2
modules.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from sexpgpu.errors import PluginError
from sexpgpu.extension import OptimizerInfo, OptimizerUpdate
from sexpgpu.lang.ir import Graph, Program
from sexpgpu_torch.dtypes import TORCH_DTYPES
from sexpgpu_torch.graphs import Slots
from sexpgpu_torch.host_memory import give_back_freed
from sexpgpu_torch.placement.base import Exported, HostCopies, Model, NormSq, States, keyed_states
from sexpgpu_torch.placement.single import Single

if TYPE_CHECKING:
    from sexpgpu_torch.distributed import TorchGroup

Tensor = torch.Tensor

__all__ = ["FullySharded", "FullyShardedTrainable", "plan_units", "rows_of"]


def plan_units(program: Program, trainable: Sequence[str]) -> tuple[list[list[str]], list[str]]:
    """The units (each iteration of a stage loss's top-level repeat: its trainable
    slot paths) and the root's paths (every other trainable path). A path any loss
    reads outside its own iteration (directly, in two iterations, in a nested
    repeat) goes to the root."""
    wanted = set(trainable)
    iterations: dict[tuple[str, ...], None] = {}  # in order; one in several losses once
    elsewhere: set[str] = set()

    def read_directly(graph: Graph) -> None:
        for node in graph.nodes:
            if node.op == "param" and node.attrs.get("path") is not None:
                elsewhere.add(node.attrs["path"])
            if node.op == "repeat":
                read_directly(node.attrs["body"])
                for slots in node.attrs["slots"]:
                    elsewhere.update(slots)  # a nested repeat's own slots

    for stage in program.stages:
        for node in stage.loss.nodes:
            if node.op == "param" and node.attrs.get("path") is not None:
                elsewhere.add(node.attrs["path"])  # read outside any repeat
            if node.op == "repeat":
                read_directly(node.attrs["body"])
                for slots in node.attrs["slots"][: int(node.attrs["count"])]:
                    iterations.setdefault(tuple(p for p in slots if p in wanted))
    shared = Counter(p for paths in iterations for p in paths)
    elsewhere.update(p for p, n in shared.items() if n > 1)
    units = [[p for p in paths if p not in elsewhere] for paths in iterations]
    units = [unit for unit in units if unit]
    in_units = {p for unit in units for p in unit}
    return units, [p for p in trainable if p not in in_units]


def rows_of(tensor: Tensor, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s slice of ``tensor`` among ``size`` (``torch.chunk`` along the
    first axis, as FSDP2 cuts; empty past the last chunk), a copy. A scalar is cut as
    a tensor of one element (FSDP2 shards no scalar)."""
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    chunks = torch.chunk(tensor.detach(), size, dim=0)
    if rank < len(chunks):
        return chunks[rank].clone()
    return tensor.new_empty((0, *tensor.shape[1:]))


class _Part(nn.Module):
    """Some trainable parameters as one FSDP2 module; its forward runs ``run`` with
    their whole values in ``ctx.params`` (as plain views) and takes them out after.
    A scalar is held as a tensor of one element (FSDP2 shards no scalar)."""

    def __init__(self, paths: Sequence[str], tensors: Sequence[Tensor], ctx: Any) -> None:
        super().__init__()
        self.paths = list(paths)
        self.ctx = ctx
        self.shapes = [tuple(t.shape) for t in tensors]
        for index, t in enumerate(tensors):
            held = t.detach().reshape(-1) if t.dim() == 0 else t.detach()
            self.register_parameter(f"p{index}", nn.Parameter(held, requires_grad=True))

    def whole(self) -> dict[str, Tensor]:
        """Each path's current (whole, while gathered) parameter as a plain view."""
        return {
            path: getattr(self, f"p{i}").view(self.shapes[i]) for i, path in enumerate(self.paths)
        }

    def forward(self, run: Callable[..., Tensor], *args: Any) -> Tensor:
        params = self.ctx.params
        params.update(self.whole())
        try:
            return run(*args)
        finally:
            for path in self.paths:
                params.pop(path, None)


class _Root(_Part):
    """The root module: its own parameters and every unit."""

    def __init__(self, paths: Sequence[str], tensors: Sequence[Tensor], ctx: Any, units: Any):
        super().__init__(paths, tensors, ctx)
        self.units = nn.ModuleList(units)


class FullyShardedTrainable:
    """One rank's slices of the trainable parameters under FSDP2 (see the module
    docstring). ``group`` is the plugin's :class:`~sexpgpu_torch.distributed.TorchGroup`."""

    def __init__(self, group: Any, device: torch.device, ctx: Any) -> None:
        self.group = group
        self.device = device
        self.ctx = ctx
        self._root: _Root | None = None
        self._params: dict[str, nn.Parameter] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}  # as declared (a scalar is held as [1])
        self._unit_of: dict[str, _Part] = {}  # by each of its paths

    @property
    def attached(self) -> bool:
        """Whether the parameters are sharded (from the first step on)."""
        return self._root is not None

    def holds(self, path: str) -> bool:
        """Whether ``path`` is one of the sharded parameters."""
        return path in self._params

    def attach(
        self,
        params: MutableMapping[str, Tensor],
        units: Sequence[Sequence[str]],
        root: Sequence[str],
    ) -> None:
        """Shard the whole tensors of ``params`` (the same on every rank) into
        ``units`` and the ``root`` (:func:`plan_units`), and take them out of
        ``params``: they come back, whole, while a module runs."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        parts = [_Part(paths, [params[p] for p in paths], self.ctx) for paths in units]
        top = _Root(root, [params[p] for p in root], self.ctx, parts)

        def shard() -> None:
            mesh = init_device_mesh(self.device.type, (self.group.size,))
            for part in parts:
                fully_shard(part, mesh=mesh, reshard_after_forward=True)
            fully_shard(top, mesh=mesh)

        self.group.call("sharding the model", shard)
        self._root = top
        for module in (top, *parts):
            for i, path in enumerate(module.paths):
                self._params[path] = getattr(module, f"p{i}")
                self._shapes[path] = module.shapes[i]
                params.pop(path, None)
        self._unit_of = {path: part for part in parts for path in part.paths}
        self.ctx.units = self
        self.group.on_close(self.release)

    def release(self) -> None:
        """Let go of the modules (and through them the process group) as it closes."""
        self._root = None
        self._unit_of = {}
        self._params = {}
        self._shapes = {}
        self.ctx.units = None

    # -- what the graphs call

    def body(
        self, run_body: Callable[[Tensor, Any], Tensor], paths: Sequence[Sequence[str]]
    ) -> Callable[[Tensor, Any], Tensor]:
        """A repeat's body for its stack kernel: iteration ``i`` runs through the unit
        of ``paths[i]`` (its parameters whole in ``ctx.params`` and in the slots)."""
        params = self.ctx.params

        def through_unit(carry: Tensor, slots: Any) -> Tensor:
            iteration = getattr(slots, "iteration", 0)
            these = paths[iteration]
            # the iteration's unit (its paths the root holds are whole all along)
            unit = next((self._unit_of[p] for p in these if p in self._unit_of), None)

            def run(c: Tensor) -> Tensor:
                return run_body(c, Slots([params[p] for p in these], iteration))

            return run(carry) if unit is None else unit(run, carry)

        return through_unit

    # -- a step

    def local(self, path: str) -> Tensor:
        """This rank's slice of ``path``'s parameter (a plain tensor, its storage)."""
        return self._params[path].to_local()

    def loss_and_grads(
        self, run: Callable[[], Tensor], paths: Sequence[str]
    ) -> tuple[Tensor, list[Tensor]]:
        """The mean of every rank's loss and this rank's slice of the averaged
        gradient of each of ``paths`` (zeros where the loss does not reach one)."""
        assert self._root is not None
        mean = self.group.backward(self._root(run), "reducing gradients")
        grads = []
        for path in paths:
            p = self._params[path]
            grad = p.grad
            p.grad = None
            grads.append(grad.to_local() if grad is not None else torch.zeros_like(p.to_local()))
        return mean, grads

    def commit(self, values: Mapping[str, Tensor]) -> None:
        """Copy each of ``values`` (this rank's slices, by path) into its parameter."""
        with torch.no_grad():
            for path, value in values.items():
                self.local(path).copy_(value)

    def set_whole(self, path: str, value: Tensor) -> None:
        """Make the whole ``value`` ``path``'s parameter (this rank keeps its slice)."""
        with torch.no_grad():
            self.local(path).copy_(rows_of(value, self.group.rank, self.group.size))

    def global_norm_sq(self, grads: Sequence[Tensor]) -> Tensor:
        """The squared L2 norm of the whole gradients, from every rank's slices."""
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        if grads:
            norms = torch._foreach_norm(list(grads), 2.0)
            local = torch.stack([n.float() for n in norms]).square().sum()
        self.group.call("summing the gradients' norm", lambda: dist.all_reduce(local))
        return local

    # -- whole tensors

    def whole_of(self, local: Tensor, like: str) -> Tensor:
        """The whole tensor of which every rank holds ``local``, its slice of a
        tensor shaped as ``like``'s parameter (an all-gather)."""
        from torch.distributed.tensor import DTensor

        p = self._params[like]
        spread = DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
        return self.group.call("gathering a tensor", spread.full_tensor).view(self._shapes[like])

    def whole(self, path: str) -> Tensor:
        """``path``'s whole parameter (an all-gather)."""
        return self.whole_of(self.local(path), path)

    def whole_at_writer(self, local: Tensor, like: str) -> Tensor | None:
        """The whole tensor of which every rank holds ``local`` (as :meth:`whole_of`)
        on the writer alone, ``None`` on the others: they send their slices and keep
        nothing (a gather to rank 0, each slice padded to ``torch.chunk``'s size)."""
        size, whole = self.group.size, self._params[like].shape
        padded = local.new_zeros((-(-whole[0] // size), *whole[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(size)] if self.group.is_writer else None
        self.group.call("gathering a tensor", lambda: dist.gather(padded, parts, dst=0))
        return None if parts is None else torch.cat(parts)[: whole[0]].view(self._shapes[like])

    @property
    def holding(self) -> bool:
        """Whether every parameter is held whole (:meth:`hold_whole`)."""
        return self.ctx.units is None and self._root is not None

    def hold_whole(self) -> None:
        """Every sharded parameter whole in ``ctx.params`` (gathered: a collective every
        rank enters) and no unit in the way, until :meth:`let_go`."""
        self.ctx.params.update({path: self.whole(path) for path in self._params})
        self.ctx.units = None

    def let_go(self) -> None:
        """Back to the slices alone, the units in the way (after :meth:`hold_whole`)."""
        if self.holding:
            for path in self._params:
                self.ctx.params.pop(path, None)
            self.ctx.units = self


class FullySharded(Single):
    """The placement of ``:shard full`` (see the module docstring): FSDP2 shards the
    trainable parameters at the first step (the warm-up's, when the strategy warms
    up), and each rank keeps its slices of them and of their states from then on;
    what is never sharded (frozen parameters), and everything before, is held whole,
    as one device holds it."""

    exports_together = True  # each tensor gathered from every rank's slices
    holds_replicas = False  # each rank holds slices: nothing to compare
    evaluates_together = True  # the first pass after a step gathers the parameters

    def __init__(self, model: Model, group: TorchGroup) -> None:
        super().__init__(model)
        self.group = group
        self.slices = FullyShardedTrainable(group, model.device, model.ctx)
        self.units = plan_units(model.program, model.trainable)

    def check_optimizers(self, optimizers: Sequence[tuple[OptimizerInfo, OptimizerUpdate]]) -> None:
        """Each rank updates its slices alone: right only for an update that computes
        each element from the same element (it says ``elementwise = True``)."""
        for info, update in optimizers:
            if not update.elementwise:
                raise PluginError(
                    f"the optimizer '{info.name}' cannot update slices of parameters "
                    "(shard full): its update does not say elementwise = True; "
                    "shard none or optimizer"
                )

    def inline_sites(self, sites: frozenset[str]) -> frozenset[str]:
        """None: each iteration of a repeat must run through its unit."""
        return frozenset()

    def set_param(self, path: str, value: Tensor, *, trainable: bool) -> None:
        """A sharded parameter keeps this rank's rows of ``value``; any other is held
        whole."""
        if self.slices.holds(path):
            self.let_go()
            self.slices.set_whole(path, value)
        else:
            super().set_param(path, value, trainable=trainable)

    def attach(self, states: States) -> States:
        """At the first step, FSDP2 shards the parameters (set already, the same on
        every rank) into the units and the root; whole states are cut to this rank's
        rows (a resume's, read before it)."""
        if self.slices.attached:
            return states
        self.slices.attach(self.model.tensors, *self.units)
        rank, size = self.group.rank, self.group.size
        return {name: [rows_of(t, rank, size) for t in values] for name, values in states.items()}

    def loss_and_grads(self, stage_loss: Callable[[], Tensor]) -> tuple[Tensor, list[Tensor]]:
        """The ranks' mean loss and this rank's slices of the averaged gradients."""
        return self.slices.loss_and_grads(stage_loss, self.model.trainable)

    def trainable_tensors(self) -> list[Tensor]:
        """This rank's slice of each trainable parameter, once sharded."""
        if not self.slices.attached:
            return super().trainable_tensors()
        return [self.slices.local(path) for path in self.model.trainable]

    def clip_norm_sq(self) -> NormSq | None:
        """The norm of the whole gradients, from every rank's slices."""
        return self.slices.global_norm_sq if self.slices.attached else None

    def commit(self, new_params: list[Tensor]) -> list[Tensor]:
        """The new slices copied into FSDP2's parameters; the proposal (which the run
        keeps a while) keeps those, letting go of its own."""
        if not self.slices.attached:
            return super().commit(new_params)
        self.slices.commit(dict(zip(self.model.trainable, new_params, strict=True)))
        return self.trainable_tensors()

    def slice_state(self, whole: Tensor) -> Tensor:
        """This rank's rows, once sharded (before, :meth:`attach` cuts them)."""
        if not self.slices.attached:
            return whole
        return rows_of(whole, self.group.rank, self.group.size)

    def hold_whole(self) -> None:
        """Every parameter gathered whole at the first call after a step (a collective
        every rank enters: its first eval batch or generation)."""
        if self.slices.attached and not self.slices.holding:
            self.slices.hold_whole()

    def let_go(self) -> None:
        """Back to the slices alone (a step runs through FSDP2's units)."""
        self.slices.let_go()

    def export(self, states: States, copies: HostCopies, *, reuse: bool) -> Exported:
        """Each tensor gathered whole from every rank's slices on the writer, and
        copied out in turn, into fresh arrays (kept ones would hold a whole model's copy
        between checkpoints); another rank sends its slices and hands back nothing."""
        if not self.slices.attached:
            return super().export(states, copies, reuse=reuse)
        self.let_go()  # a pass's whole parameters: not on top of the host copies
        give_back_freed()  # nor what the steps' gathers freed (glibc keeps it)
        model, slices, writer = self.model, self.slices, self.group.is_writer
        shapes = {path: tuple(d.type.shape) for path, d in model.decls.items()}
        kinds = {path: _host_dtype(d.type.dtype) for path, d in model.decls.items()}
        kept = model.kept()
        names = keyed_states(model.trainable, list(states), lambda i, n: (i, model.trainable[i], n))
        params, whole_states = {}, {}
        if writer:  # the others send their slices and keep nothing
            params = copies.layout({path: (shapes[path], kinds[path]) for path in kept})
            whole_states = copies.layout(
                {key: (shapes[path], "float32") for key, (_, path, _) in names.items()}
            )
        for path in kept:  # a gather every rank enters, in the same order
            held = slices.holds(path)
            whole = (
                slices.whole_at_writer(slices.local(path), path) if held else model.tensors[path]
            )
            if writer:
                copies.copy_to_host({path: params[path]}, {path: whole})
        for key, (i, path, name) in names.items():
            whole = slices.whole_at_writer(states[name][i], path)
            if writer:
                copies.copy_to_host({key: whole_states[key]}, {key: whole})
        return params, whole_states


def _host_dtype(dtype: str) -> str:
    """The dtype a checkpoint's file holds a parameter of IR ``dtype`` in (bf16 as f32)."""
    if dtype in ("f32", "bf16"):
        return "float32"
    return str(TORCH_DTYPES[dtype]).removeprefix("torch.")
