"""The torch plugin: the CPU/CUDA lowering, its kernels, and the optimizers.

Importing this module must stay cheap: torch is imported by the factories only.
"""

from __future__ import annotations

from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_lowerings():
    return []


@hookimpl
def sexpgpu_kernels():
    return []


@hookimpl
def sexpgpu_optimizers():
    return []
