"""The compiled lowering: every graph of a program through ``torch.compile`` (inductor).

It serves ``cuda``, where it is the default, and ``cpu`` when a run asks for it
(``sexpgpu run --lowering compiled``), so that everything but the CUDA kernels is
tested on machines without a GPU. It reuses the eager torch lowering's op table,
trainer and optimizers (:mod:`sexpgpu_torch`); what it adds is tracing and
compiling, the CUDA kernel choices (attention backends, convolution engines,
TF32), the CUDA determinism switches, and a checkpoint snapshot into pinned host
buffers on a side stream. Importing this module stays cheap: torch is imported by
the factories only. See docs/cuda.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sexpgpu.extension import KernelInfo, LoweringInfo, module_missing
from sexpgpu.hookspecs import hookimpl
from sexpgpu_torch import join_group, torch_environment

LOWERING = "compiled"
"""The lowering's name: ``--lowering compiled``, ``KernelInfo.lowering`` of its kernels,
and the value of the recorded choice ``lowering``."""


def _lowering_factory() -> Any:
    from sexpgpu_cuda.trainer import CompiledLowering

    return CompiledLowering()


@hookimpl
def sexpgpu_unavailable() -> str | None:
    """Unavailable without torch (looked up, not imported)."""
    return module_missing("torch", "pip install torch (see https://pytorch.org for CUDA builds)")


@hookimpl
def sexpgpu_lowerings() -> list[LoweringInfo]:
    """The compiled lowering: the default on ``cuda``, asked for by name on ``cpu``."""
    return [
        LoweringInfo(
            name=LOWERING,
            devices=("cuda", "cpu"),
            factory=_lowering_factory,
            group=join_group,  # the ranks are torch.distributed's, as eager's are
            environment=torch_environment,  # torch's own settings, as eager's are
            doc="torch.compile (inductor) of every graph: loss and backward, update, eval",
            default_for=("cuda",),
        )
    ]


def _kernel(name: str) -> Callable[[], Callable[..., Any]]:
    def factory() -> Callable[..., Any]:
        from sexpgpu_cuda import kernels

        return getattr(kernels, name)

    return factory


# (kind, name, function, deterministic, priority, doc): this lowering's own kernels.
# Beside them it calls every kernel of the eager torch lowering (math, sdpa, direct,
# unrolled, looped), which run under a trace as they run eagerly.
_KERNELS = (
    # torch's flash backward takes its deterministic path when the determinism switch
    # is on, which a deterministic run sets
    ("attention", "flash", "attention_flash", True, 30, "SDPA, flash backend only (sm80+, bf16)"),
    ("attention", "cudnn", "attention_cudnn", False, 25, "SDPA, cuDNN backend only (sm80+)"),
    (
        "attention",
        "efficient",
        "attention_efficient",
        False,
        20,
        "SDPA, memory-efficient backend only (atomics in its backward)",
    ),
    ("attention", "sdpa-math", "attention_sdpa_math", True, 5, "SDPA, its math backend only"),
    ("conv2d", "cudnn", "conv2d_cudnn", True, 10, "cuDNN, deterministic algorithms, no autotuning"),
    (
        "conv2d",
        "cudnn-benchmark",
        "conv2d_cudnn_benchmark",
        False,
        20,
        "cuDNN, algorithms chosen by benchmarking each shape",
    ),
    (
        "stack",
        "recompute",
        "stack_recompute",
        True,
        -10,
        "a repeat whose iterations recompute their activations in the backward pass "
        "(activation checkpointing): the recompute budget, per repeat",
    ),
)

_ANY_DEVICE = ("stack",)
"""Kinds whose kernels here run on the CPU as well (nothing CUDA-specific in them)."""


@hookimpl
def sexpgpu_kernels() -> list[KernelInfo]:
    """CUDA attention backends, cuDNN convolution engines, and recomputing stacks."""
    return [
        KernelInfo(
            kind=kind,
            name=name,
            lowering=LOWERING,
            devices=("cuda", "cpu") if kind in _ANY_DEVICE else ("cuda",),
            deterministic=deterministic,
            factory=_kernel(function),
            priority=priority,
            doc=doc,
        )
        for kind, name, function, deterministic, priority, doc in _KERNELS
    ]
