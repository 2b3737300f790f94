"""Parameters' initial values, drawn from the run's seed (no global generator)."""

from __future__ import annotations

import numpy as np
import torch

from sexpgpu.errors import RunError
from sexpgpu.lang.ir import ParamDecl
from sexpgpu_torch.rng import derive_seed

Tensor = torch.Tensor


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    # Our matrices are used as `x @ W`, so a 2-D [in, out] parameter has fan-in
    # shape[0]; higher ranks follow the conv layout [out, in, k...].
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive = int(np.prod(shape[2:]))
    return shape[1] * receptive, shape[0] * receptive


def init_tensor(decl: ParamDecl, seed: int) -> Tensor:
    """``decl``'s initial value as an f32 CPU tensor drawn from ``(seed, "init", path)``.

    ``normal(std)``, ``uniform(low, high)``, ``zeros``, ``ones``,
    ``xavier(gain=1)`` (uniform, bound ``gain*sqrt(6/(fan_in+fan_out))``) and
    ``kaiming(gain=sqrt(2))`` (normal, std ``gain/sqrt(fan_in)``).
    """
    shape = tuple(decl.type.shape)
    kind, args = decl.init.kind, tuple(decl.init.args)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(derive_seed(seed, "init", decl.path))
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "ones":
        return torch.ones(shape)
    if kind == "normal":
        std = args[0] if args else 1.0
        mean = args[1] if len(args) > 1 else 0.0
        return torch.randn(shape, generator=gen) * std + mean
    if kind == "uniform":
        if len(args) >= 2:
            low, high = args[0], args[1]
        elif args:
            low, high = -args[0], args[0]
        else:
            low, high = 0.0, 1.0
        return torch.rand(shape, generator=gen) * (high - low) + low
    fan_in, fan_out = _fans(shape)
    if kind == "xavier":
        gain = args[0] if args else 1.0
        bound = gain * (6.0 / (fan_in + fan_out)) ** 0.5
        return (torch.rand(shape, generator=gen) * 2 - 1) * bound
    if kind == "kaiming":
        gain = args[0] if args else 2.0**0.5
        return torch.randn(shape, generator=gen) * (gain / fan_in**0.5)
    raise RunError(f"unknown initializer '{kind}' for {decl.path}", pos=decl.pos)
