"""The torch plugin's two lowerings, one trainer: ``torch`` (eager) and ``compiled``.

Each takes the machine's switches its strategy needs, chooses a kernel per choice
site by the core's rule, takes the pinned CPU choices, and builds a
:class:`~sexpgpu_torch.trainer.TorchTrainer` with its strategy:
:class:`~sexpgpu_torch.strategy.Eager` or :class:`~sexpgpu_torch.compiled.Compiled`.
The compiled lowering calls its own kernels (``recompute``, and the ``cuda``
plugin's) and every kernel of the eager lowering, traced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from sexpgpu.choices import Choices, cannot_take
from sexpgpu.errors import PluginError, UsageError
from sexpgpu.extension import KernelInfo, Supplies
from sexpgpu.kernels import choose_kernels, device_kind
from sexpgpu.lang.ir import Program
from sexpgpu_torch.compiled import BACKEND, Compiled, prepare_caches, take_update
from sexpgpu_torch.cpu import take as take_cpu_choices
from sexpgpu_torch.cuda import (
    runnable,
    take_alignment,
    take_conv_engine,
    take_eager_determinism,
    take_switches,
)
from sexpgpu_torch.names import COMPILED, LOWERING, UPDATE
from sexpgpu_torch.placement import take_shard
from sexpgpu_torch.strategy import Eager
from sexpgpu_torch.threads import choose as choose_threads
from sexpgpu_torch.trainer import TorchTrainer

COMPILE_BACKEND = "compile.backend"
"""The recorded choice naming torch.compile's backend."""


class EagerLowering:
    """The :class:`sexpgpu.extension.Lowering` named ``torch``, on ``cpu`` and ``cuda``."""

    def lower(
        self, program: Program, *, device: str, supplies: Supplies, choices: Choices
    ) -> TorchTrainer:
        """Choose a kernel per site, compile every graph, and build the trainer."""
        kind = device_kind(device)
        if kind not in ("cpu", "cuda"):
            raise PluginError(f"the torch lowering cannot run on '{device}' (cpu or cuda)")
        if kind == "cuda" and not torch.cuda.is_available():
            raise PluginError(f"--device {device}: torch sees no CUDA device here")
        if choices.is_request(UPDATE):  # a pinned one is a compiled run's, evaluated eagerly
            raise UsageError(
                f"{choices.words(UPDATE)}: the eager lowering updates with its own ops; "
                "the choice is the compiled lowering's (--lowering compiled)"
            )
        take_eager_determinism(program, device)
        here = runnable(supplies.kernels, program, device)
        chosen = choose_kernels(
            program, lowering=LOWERING, device=device, kernels=here, choices=choices
        )
        take_conv_engine(chosen, device)
        # Before any graph is built: the sums are the pinned threads' from the start.
        cpu_choices = take_cpu_choices(choices.pins(), device, choose_threads(program))
        align, aligned = take_alignment(device, choices.pins())
        shard = take_shard(program, choices)
        return TorchTrainer(
            program,
            device=device,
            chosen=chosen,
            optimizers=supplies.optimizers,
            ops=supplies.ops,
            strategy=Eager(),
            made={**cpu_choices, **aligned},
            shard=shard,
            align=align,
        )


class CompiledLowering:
    """The :class:`sexpgpu.extension.Lowering` named ``compiled``: the default on
    ``cuda``, asked for by name on ``cpu``."""

    def lower(
        self, program: Program, *, device: str, supplies: Supplies, choices: Choices
    ) -> TorchTrainer:
        """Take the machine's switches, choose a kernel per site, and wrap every graph
        in ``torch.compile`` (compiled on first call, or all at once by ``warm_up``)."""
        kind = device_kind(device)
        if kind not in ("cpu", "cuda"):
            raise PluginError(f"the compiled lowering cannot run on '{device}' (cpu or cuda)")
        prepare_caches()
        backend = choices.pin(COMPILE_BACKEND) or BACKEND
        if backend != BACKEND:
            raise cannot_take(COMPILE_BACKEND, backend, f"this lowering compiles with {BACKEND}")
        pins = choices.pins()
        switches = take_switches(program, device, pins)
        here = runnable(callable_when_compiled(supplies.kernels), program, device)
        chosen = choose_kernels(
            program, lowering=COMPILED, device=device, kernels=here, choices=choices
        )
        take_conv_engine(chosen, device)
        cpu_choices = take_cpu_choices(pins, device, choose_threads(program))
        align, aligned = take_alignment(device, pins)
        shard = take_shard(program, choices)
        update = take_update(choices)
        return TorchTrainer(
            program,
            device=device,
            chosen=chosen,
            optimizers=supplies.optimizers,
            ops=supplies.ops,
            strategy=Compiled(torch.device(device), update),
            made={**cpu_choices, **switches, **aligned, COMPILE_BACKEND: BACKEND, UPDATE: update},
            shard=shard,
            align=align,
        )


def callable_when_compiled(kernels: Sequence[KernelInfo]) -> list[KernelInfo]:
    """Every kernel the compiled lowering calls: its own, and the eager lowering's (the
    same torch functions, traced) where it has none of that kind and name."""
    own = {(k.kind, k.name) for k in kernels if k.lowering == COMPILED}
    borrowed = [
        dataclasses.replace(k, lowering=COMPILED)
        for k in kernels
        if k.lowering == LOWERING and (k.kind, k.name) not in own
    ]
    return [k for k in kernels if k.lowering == COMPILED] + borrowed
