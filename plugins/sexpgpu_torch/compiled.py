"""The compiled strategy: the trainer's graphs through ``torch.compile`` (inductor).

:class:`Compiled` wraps the very functions the eager strategy runs: each stage's
loss (AOTAutograd compiles its backward with it) and each eval pass. A built-in
optimizer updates through torch's fused kernels (:mod:`sexpgpu_torch.fused_optim`,
nothing to compile) or as one compiled graph (:mod:`sexpgpu_torch.compiled_optim`),
as the recorded ``optimizer.update`` says. The numbers agree with the eager
lowering's within float tolerance, and a resume takes the same compiled code and
update as the run it continues (bit for bit).

A run compiles every graph before its first step (the trainer's ``warm_up``, which
the run calls once after lowering), on stand-in tensors of the program's shapes, so
the first step pays nothing and ``run started`` can say how long it took. Nothing
else compiles up front: ``sexpgpu evaluate`` never warms up, and torch compiles
each eval pass it runs on its first call. torch's on-disk caches make a second
start of the same program on the same machine (a resume) reuse the artifacts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sexpgpu.choices import Choices, cannot_take
from sexpgpu.extension import OptimizerUpdate
from sexpgpu.log import get_logger
from sexpgpu_torch.compiled_optim import CompiledUpdate
from sexpgpu_torch.cuda import PinnedSnapshots
from sexpgpu_torch.fused_optim import FusedUpdate
from sexpgpu_torch.graphs import Ctx
from sexpgpu_torch.isa_probe import remember_probes
from sexpgpu_torch.names import UPDATE, UPDATES
from sexpgpu_torch.recompiles import CompiledOnce, watching
from sexpgpu_torch.strategy import GraphFn, copy_plainly

if TYPE_CHECKING:
    from sexpgpu_torch.trainer import Proposal

Tensor = torch.Tensor

BACKEND = "inductor"
"""torch.compile's backend, recorded as the choice ``compile.backend``."""

DEFAULT_UPDATE = "fused"
"""A new run's update: nothing to compile, and the kernels ``torch.optim`` takes with
``fused=True`` (a checkpoint that recorded no update ran ``compiled``)."""


def take_update(choices: Choices) -> str:
    """The update a compiled run takes (the recorded ``optimizer.update``: fused kernels,
    :mod:`sexpgpu_torch.fused_optim`, or one compiled graph,
    :mod:`sexpgpu_torch.compiled_optim`): the requested or pinned one, ``compiled``
    for a checkpoint written before the choice was recorded, else
    :data:`DEFAULT_UPDATE`."""
    value = choices.pin(UPDATE)
    if value is None:
        continued = choices.pinned and bool(choices.recorded)
        return "compiled" if continued else DEFAULT_UPDATE
    if value not in UPDATES:
        raise cannot_take(UPDATE, value, f"it is none of {', '.join(UPDATES)}")
    return value


def prepare_caches() -> None:
    """Turn on torch's on-disk caches of compiled graphs (inductor's FX graph cache and
    AOTAutograd's), so a second start of a program on this machine reuses them.
    Their folder is torch's: ``TORCHINDUCTOR_CACHE_DIR``. inductor's check of the CPU's
    vector instructions is noted there too (:mod:`sexpgpu_torch.isa_probe`)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    if hasattr(functorch_config, "enable_autograd_cache"):
        functorch_config.enable_autograd_cache = True
    remember_probes()


def compile_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` through ``torch.compile``, compiled on its first call; a compile after
    that is said in the log (:class:`CompiledOnce`)."""
    # dynamic=False: a program's shapes are fixed, and static shapes compile the
    # fastest kernels; a graph reads its tensors through the trainer's dicts
    return CompiledOnce(torch.compile(fn, backend=BACKEND, dynamic=False))


# ---------------------------------------------------------------- dropout masks as inputs


class MaskedCtx(Ctx):
    """A graph's context whose dropout masks come in as inputs of the trace, drawn
    beforehand exactly as the eager lowering draws them, so that no trace depends on
    the step number (which would compile again every step).

    While ``wanted`` is a list (an eager pass before compiling), each dropout draws
    its mask and notes (key, iteration, shape, keep) there.
    """

    __slots__ = ("wanted",)

    fuses = True  # inductor fuses elementwise work into the reductions reading it

    def __init__(self, seed: int, device: torch.device) -> None:
        super().__init__(seed, device)
        self.wanted: list[tuple] | None = None

    def dropout_mask(
        self, shape: Sequence[int], keep: float, key: int, iteration: int | None
    ) -> Tensor:
        """The mask handed in (:func:`mask_name`), or drawn and noted in an eager pass."""
        if self.wanted is not None:
            self.wanted.append((key, iteration, tuple(shape), keep))
            return self.draw_mask(shape, keep, key, iteration)
        return self.inputs[mask_name(key, iteration)]

    def draw_mask(
        self, shape: Sequence[int], keep: float, key: int, iteration: int | None
    ) -> Tensor:
        """The mask the eager lowering draws for this dropout at this step."""
        return super().dropout_mask(shape, keep, key, iteration)


def mask_name(key: int, iteration: int | None) -> str:
    """The input that carries a dropout's mask into a compiled graph."""
    return f"dropout:{key}:{iteration}"


class MaskedLoss:
    """A stage's loss graph compiled, its dropout masks handed in as inputs.

    On its first call one eager forward pass (no gradients) notes the graph's
    dropouts; each call then draws the step's masks eagerly, from the step number,
    puts them among the context's inputs, and runs the compiled graph.
    """

    def __init__(self, graph: GraphFn, ctx: MaskedCtx) -> None:
        self.eager = graph
        self.compiled = compile_function(graph)
        self.ctx = ctx
        self.dropouts: list[tuple] | None = None
        """The graph's dropouts (key, iteration, shape, keep), found on the first call."""

    def __call__(self) -> list[Tensor]:
        ctx = self.ctx
        if self.dropouts is None:
            self.dropouts = self._find_dropouts()
        for key, iteration, shape, keep in self.dropouts:
            ctx.inputs[mask_name(key, iteration)] = ctx.draw_mask(shape, keep, key, iteration)
        return self.compiled()

    def _find_dropouts(self) -> list[tuple]:
        """One eager forward pass on the step's inputs, noting its dropouts; the masks
        it draws go unused."""
        ctx = self.ctx
        ctx.wanted = []
        try:
            with torch.no_grad():
                self.eager()
            return list(dict.fromkeys(ctx.wanted))
        finally:
            ctx.wanted = None


# ---------------------------------------------------------------- the strategy


class Compiled:
    """The ``compiled`` lowering's strategy (see the module docstring). On CUDA a
    checkpoint's tensors are copied into pinned host buffers on a side stream."""

    reads_loss_late = True
    """A loss read waits for the device (on CUDA): the run reads it a step late."""
    fixed_shapes = True
    """A new shape compiles again: a generator's cache is read whole, masked."""

    def __init__(self, device: torch.device, update: str = DEFAULT_UPDATE) -> None:
        self.snapshots = PinnedSnapshots(device) if device.type == "cuda" else None
        self.update_kind = update  # the recorded optimizer.update

    def context(self, seed: int, device: torch.device) -> MaskedCtx:
        """A context whose dropout masks enter the compiled graphs as inputs."""
        return MaskedCtx(seed, device)

    def autocasts(self, precision: str, device: torch.device) -> bool:
        """bf16 compute under autocast on either device; parameters, the loss the run
        reads and the optimizer's math stay f32 (the trainer's rules)."""
        return precision == "bf16"

    def stage_loss(self, graph: GraphFn, ctx: Ctx) -> GraphFn:
        """The graph compiled, its masks handed in (:class:`MaskedLoss`)."""
        if not isinstance(ctx, MaskedCtx):
            raise TypeError("the compiled strategy's graphs read the context it made")
        return MaskedLoss(graph, ctx)

    def update(self, update: OptimizerUpdate, *, overwrites: bool) -> OptimizerUpdate:
        """A built-in update through torch's fused kernel or as one compiled graph (the
        recorded ``optimizer.update``); a plugin's update as it is."""
        if self.update_kind == "fused":
            return FusedUpdate(update, overwrites=overwrites)
        return CompiledUpdate(update, BACKEND)

    def evaluation(self, graph: GraphFn) -> GraphFn:
        """The graph compiled (on its first call)."""
        return compile_function(graph)

    def warm_up(self, run_every_graph: Callable[[], None], device: torch.device) -> float:
        """Compile every graph now, by running each once; the seconds it took. A graph
        torch could not trace whole is said once (``graph breaks``)."""
        started = time.perf_counter()
        breaks_before = dict(_graph_breaks())
        run_every_graph()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = round(time.perf_counter() - started, 3)
        _report_graph_breaks(breaks_before)
        return seconds

    def watching(self) -> AbstractContextManager[None]:
        """dynamo's recompile check set once for the stretch (:func:`watching`)."""
        return watching()

    def read_flag(self, found: Tensor, proposal: Proposal) -> bool:
        """The flag and the step's loss in one transfer: a guarded step costs one host
        sync, not two. The proposal keeps the loss read."""
        loss = proposal.loss_tensor.detach().float().reshape(1)
        flag, value = torch.cat([found, loss]).tolist()
        proposal.keep_loss(value)
        return bool(flag)

    def copy_to_host(self, arrays: Mapping[str, np.ndarray], tensors: Mapping[str, Tensor]) -> None:
        """On CUDA, into pinned host buffers on a side stream (:class:`PinnedSnapshots`):
        the loop waits for the copy only; on the CPU, a plain copy."""
        if self.snapshots is None:
            copy_plainly(arrays, tensors)
        else:
            self.snapshots.copy(arrays, tensors)


def _graph_breaks() -> Mapping[str, int]:
    from torch._dynamo.utils import counters

    return counters["graph_break"]


def _report_graph_breaks(before: Mapping[str, int]) -> None:
    # A graph break (an op torch cannot trace, a plugin's kernel) is no error: the
    # graph runs partly eagerly, slower. Said once, so a slow run is explained.
    new = {k: n - before.get(k, 0) for k, n in _graph_breaks().items() if n > before.get(k, 0)}
    if new:
        get_logger("sexpgpu.run").warning(
            "graph breaks: part of the program runs eagerly",
            breaks=sum(new.values()),
            reason=str(next(iter(new))).splitlines()[0][:200],
        )
