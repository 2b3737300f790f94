"""The compiled lowering: the eager torch trainer with every graph run through
``torch.compile``.

:class:`CompiledTrainer` is :class:`sexpgpu_torch.trainer.TorchTrainer` (parameters,
states, propose/commit, the fused finite guard, export, restore) whose graphs are
traced and compiled by inductor: each stage's loss (AOTAutograd compiles its
backward with it), each optimizer update, and each eval pass. Nothing else differs,
so the numbers agree with the eager lowering's within float tolerance and a resume
takes the same compiled code as the run it continues (bit for bit).

A run compiles every graph before its first step (:meth:`CompiledTrainer.warm_up`,
which the run calls once after lowering), on stand-in tensors of the program's
shapes, so the first step pays nothing and ``run started`` can say how long it took.
Nothing else compiles up front: ``sexpgpu evaluate`` never warms up, and torch
compiles each eval pass it runs on its first call. torch's on-disk caches make a
second start of the same program on the same machine (a resume) reuse the artifacts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from sexpgpu.choices import Choices, cannot_take
from sexpgpu.errors import PluginError
from sexpgpu.extension import KernelInfo, OpInfo, OptimizerInfo, Supplies
from sexpgpu.graph import Program
from sexpgpu.kernels import choose_kernels, device_kind
from sexpgpu.log import get_logger
from sexpgpu_cuda import LOWERING
from sexpgpu_cuda import device as machine
from sexpgpu_cuda.optim import CompiledUpdate
from sexpgpu_torch.cpu import take as take_cpu_choices
from sexpgpu_torch.lowering import LOWERING as EAGER
from sexpgpu_torch.lowering import TORCH_DTYPES, Ctx, Tensor
from sexpgpu_torch.trainer import TorchTrainer

BACKEND = "inductor"
COMPILE_BACKEND = "compile.backend"
"""The recorded choice naming torch.compile's backend."""

_NUMPY: dict[str, Any] = {"f32": np.float32, "bf16": np.float32, "i64": np.int64, "bool": np.bool_}


class CompiledCtx(Ctx):
    """A graph's context whose dropout masks come in as inputs of the trace, drawn
    beforehand exactly as the eager lowering draws them, so that no trace depends on
    the step number (which would compile again every step).

    While ``wanted`` is a list (an eager pass before compiling), each dropout draws
    its mask and notes (key, iteration, shape, keep) there.
    """

    __slots__ = ("wanted",)

    def __init__(self, seed: int, device: torch.device) -> None:
        super().__init__(seed, device)
        self.wanted: list[tuple] | None = None

    def dropout_mask(
        self, shape: Sequence[int], keep: float, key: int, iteration: int | None
    ) -> Tensor:
        """The mask handed in (:func:`mask_name`), or drawn and noted in an eager pass."""
        if self.wanted is not None:
            self.wanted.append((key, iteration, tuple(shape), keep))
            return super().dropout_mask(shape, keep, key, iteration)
        return self.inputs[mask_name(key, iteration)]


def mask_name(key: int, iteration: int | None) -> str:
    """The input that carries a dropout's mask into a compiled graph."""
    return f"dropout:{key}:{iteration}"


class CompiledTrainer(TorchTrainer):
    """The :class:`sexpgpu.extension.Trainer` of the compiled lowering."""

    ctx_type = CompiledCtx

    def __init__(
        self,
        program: Program,
        *,
        device: str,
        chosen: Mapping[str, KernelInfo],
        optimizers: Mapping[str, OptimizerInfo],
        ops: Sequence[OpInfo] = (),
    ) -> None:
        super().__init__(program, device=device, chosen=chosen, optimizers=optimizers, ops=ops)
        # bf16 compute under autocast on either device; parameters, the loss the
        # run reads and the optimizer's math stay f32 (the eager trainer's rules)
        self.autocast = program.run.precision == "bf16"
        self._eager_loss = list(self.stage_loss)
        # each stage's dropouts (key, iteration, shape, keep), noted on its first step
        self.dropouts: list[list[tuple] | None] = [None for _ in program.stages]
        self.stage_loss = [
            self._with_masks(stage, _compile(fn)) for stage, fn in enumerate(self.stage_loss)
        ]
        self.updates = [
            (CompiledUpdate(update, BACKEND), options) for update, options in self.updates
        ]
        self.evals = {name: (decl, _compile(run)) for name, (decl, run) in self.evals.items()}
        self.compile_seconds: float | None = None  # set by warm_up
        # On CUDA a loss read waits for the device: the run reads it a step late.
        self.reads_loss_late = True
        self.snapshots = device_snapshots(self.device)

    def _with_masks(self, stage: int, compiled: Callable[[], Any]) -> Callable[[], Any]:
        ctx = self.ctx

        def run() -> Any:
            wanted = self.dropouts[stage]
            if wanted is None:
                wanted = self.dropouts[stage] = self._find_dropouts(stage)
            # the step's masks, drawn eagerly from the step number, enter as inputs
            for key, iteration, shape, keep in wanted:
                mask = Ctx.dropout_mask(ctx, shape, keep, key, iteration)
                ctx.inputs[mask_name(key, iteration)] = mask
            return compiled()

        return run

    def _find_dropouts(self, stage: int) -> list[tuple]:
        """One eager forward pass of ``stage``'s loss on the step's inputs, noting its
        dropouts (no gradients); the masks it draws go unused."""
        ctx = self.ctx
        ctx.wanted = []
        try:
            with torch.no_grad():
                self._eager_loss[stage]()
            return list(dict.fromkeys(ctx.wanted))
        finally:
            ctx.wanted = None

    def warm_up(self) -> float:
        """Compile every stage's loss, backward and update, and every eval pass, now, on
        zero stand-ins of the program's tensors (nothing of the run changes); returns
        the seconds taken. The run calls it once, before any parameter is set; without
        it each graph compiles on its first call."""
        started = time.perf_counter()
        breaks_before = dict(_graph_breaks())
        for decl in self.decls:
            t = torch.zeros(
                decl.type.shape, dtype=TORCH_DTYPES[decl.type.dtype], device=self.device
            )
            self.params[decl.path] = t.requires_grad_(decl.trainable)
        try:
            for stage, decl in enumerate(self.program.stages):
                batch = _zeros(decl.data.fields)
                first = self.group_start[stage] + 1
                self.propose(batch, stage=stage, step=first, lr=1e-3)
            for eval_pass in self.program.evals:
                self.evaluate(eval_pass.name, _zeros(eval_pass.data.fields))
        finally:
            self.params.clear()
            self.states = {}
            self.current_group = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.compile_seconds = round(time.perf_counter() - started, 3)
        _report_graph_breaks(breaks_before)
        return self.compile_seconds

    def find_non_finite(self, proposal: Any) -> tuple[str, str, int] | None:
        """The eager trainer's fused check (one kernel per dtype over every proposed
        tensor), with the step's loss downloaded in the same transfer as the flag: a
        guarded step costs one host sync, not two. The offender is looked for (by the
        eager trainer) only when the flag is up."""
        found = self.non_finite_flag(proposal)
        if found is None:
            return None
        loss = proposal.loss_tensor.detach().float().reshape(1)
        flag, proposal._loss = torch.cat([found, loss]).tolist()
        return self.first_non_finite(proposal) if flag else None

    def copy_to_host(self, arrays: Mapping[str, np.ndarray], tensors: Mapping[str, Tensor]) -> None:
        """On CUDA, into pinned host buffers on a side stream (``machine.PinnedSnapshots``):
        the loop waits for the copy only; on the CPU, as the eager trainer copies."""
        if self.snapshots is None:
            super().copy_to_host(arrays, tensors)
        else:
            self.snapshots.copy(arrays, tensors)


def _zeros(fields: Mapping[str, Any]) -> dict[str, np.ndarray]:
    # a batch of zeros: valid ids for every table, and the shapes the run will feed
    return {
        name: np.zeros(t.shape, dtype=_NUMPY.get(t.dtype, np.float32)) for name, t in fields.items()
    }


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


def _compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    # dynamic=False: a program's shapes are fixed, and static shapes compile the
    # fastest kernels; a graph reads its tensors through the trainer's dicts
    return torch.compile(fn, backend=BACKEND, dynamic=False)


def device_snapshots(where: torch.device) -> Any:
    """The pinned snapshot machinery on CUDA; ``None`` on the CPU (nothing to copy)."""
    return machine.PinnedSnapshots(where) if where.type == "cuda" else None


def _callable_here(kernels: Sequence[KernelInfo]) -> list[KernelInfo]:
    """Every kernel this lowering calls: its own, and the eager lowering's (the same
    torch functions, traced) where it supplies none of that kind and name."""
    own = {(k.kind, k.name) for k in kernels if k.lowering == LOWERING}
    borrowed = [
        dataclasses.replace(k, lowering=LOWERING)
        for k in kernels
        if k.lowering == EAGER and (k.kind, k.name) not in own
    ]
    return [k for k in kernels if k.lowering == LOWERING] + borrowed


class CompiledLowering:
    """The :class:`sexpgpu.extension.Lowering` named ``compiled``."""

    def lower(
        self, program: Program, *, device: str, supplies: Supplies, choices: Choices
    ) -> CompiledTrainer:
        """Take the machine's switches, choose a kernel per site, and wrap every graph
        in ``torch.compile`` (compiled on first call, or all at once by ``warm_up``)."""
        kind = device_kind(device)
        if kind not in ("cpu", "cuda"):
            raise PluginError(f"the compiled lowering cannot run on '{device}' (cpu or cuda)")
        machine.prepare_caches()
        backend = choices.pin(COMPILE_BACKEND) or BACKEND
        if backend != BACKEND:
            raise cannot_take(COMPILE_BACKEND, backend, f"this lowering compiles with {BACKEND}")
        pins = choices.pins()
        switches = machine.take_switches(program, device, pins)
        here = machine.runnable(_callable_here(supplies.kernels), program, device)
        chosen = choose_kernels(
            program, lowering=LOWERING, device=device, kernels=here, choices=choices
        )
        machine.take_conv_engine(chosen, device)
        cpu_choices = take_cpu_choices(pins, device)
        trainer = CompiledTrainer(
            program,
            device=device,
            chosen=chosen,
            optimizers=supplies.optimizers,
            ops=supplies.ops,
        )
        trainer.choices.update(cpu_choices)
        trainer.choices.update(switches)
        trainer.choices[COMPILE_BACKEND] = BACKEND
        return trainer
