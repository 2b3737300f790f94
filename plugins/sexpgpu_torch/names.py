"""The names this plugin's lowerings go by (no torch here: the plugin's descriptors
and the CUDA kernels' plugin read them without importing torch).

Each is a lowering's name: ``--lowering NAME``, ``KernelInfo.lowering`` of the
kernels it calls, and the value of the recorded choice ``lowering``.
"""

from __future__ import annotations

LOWERING = "torch"
"""The eager lowering: each graph run op by op as PyTorch executes it (the CPU's default)."""

COMPILED = "compiled"
"""The compiled lowering: every graph through ``torch.compile`` (CUDA's default)."""

UPDATE = "optimizer.update"
"""The recorded choice of how the compiled lowering's built-in optimizers update:
``fused`` (torch's fused kernels) or ``compiled`` (one compiled graph); ``sexpgpu run
--update``."""

UPDATES = ("fused", "compiled")
"""The values of :data:`UPDATE`."""
