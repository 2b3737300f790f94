"""The CUDA plugin: the kernels that run on CUDA only, for the torch plugin's two
lowerings (eager ``torch`` and ``compiled``).

Attention through one SDPA backend each (``flash``, ``cudnn``, ``efficient``,
``sdpa-math``) and convolution through cuDNN's engines (``cudnn``,
``cudnn-benchmark``). The lowerings that call them are the torch plugin's
(:mod:`sexpgpu_torch`), as are what they set on a CUDA machine (the determinism
and TF32 switches, which of these kernels this GPU can run, the cuDNN engine of
the chosen convolutions) and the pinned checkpoint snapshots; this plugin builds on
them. Each kernel is offered to both lowerings: the eager one on a GPU picks flash
attention where it is deterministic, as the compiled one does (before, it had only
the eager ``math`` and ``sdpa`` kernels and ran ``math``). Importing this module stays cheap: torch is imported by the factories
only. See docs/cuda.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sexpgpu.extension import KernelInfo, module_missing
from sexpgpu.hookspecs import hookimpl
from sexpgpu_torch.names import COMPILED, LOWERING


@hookimpl
def sexpgpu_unavailable() -> str | None:
    """Unavailable without torch (looked up, not imported)."""
    return module_missing("torch", "pip install torch (see https://pytorch.org for CUDA builds)")


def _kernel(name: str) -> Callable[[], Callable[..., Any]]:
    def factory() -> Callable[..., Any]:
        from sexpgpu_cuda import kernels

        return getattr(kernels, name)

    return factory


# (kind, name, function, deterministic, priority, doc): the CUDA kernels of both
# lowerings. Beside them the compiled one calls every kernel of the eager lowering
# (math, sdpa, direct, unrolled, looped), which run under a trace as they run eagerly.
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
)


@hookimpl
def sexpgpu_kernels() -> list[KernelInfo]:
    """CUDA attention backends and cuDNN convolution engines, for either lowering."""
    return [
        KernelInfo(
            kind=kind,
            name=name,
            lowering=lowering,
            devices=("cuda",),
            deterministic=deterministic,
            factory=_kernel(function),
            priority=priority,
            doc=doc,
        )
        for kind, name, function, deterministic, priority, doc in _KERNELS
        for lowering in (LOWERING, COMPILED)
    ]
