"""Learning-rate schedules: what a program's ``:schedule`` makes of its rate at each
step, computed here so every lowering agrees to the bit."""

from __future__ import annotations

import math

from sexpgpu.lang.ir import OptimizerDecl


def lr_at(optimizer: OptimizerDecl, step_in_stage: int, stage_steps: int) -> float:
    """The learning rate for the 1-based ``step_in_stage`` of a stage of ``stage_steps`` steps."""
    base = float(optimizer.options.get("lr", 0.0))
    schedule = optimizer.schedule
    if schedule.kind == "constant":
        return base
    warmup = max(0, schedule.warmup)
    if step_in_stage <= warmup:
        return base * step_in_stage / warmup
    if schedule.kind == "warmup":
        return base
    if schedule.kind == "cosine":
        span = max(1, stage_steps - warmup)
        progress = min(1.0, (step_in_stage - warmup) / span)
        return schedule.min_lr + 0.5 * (base - schedule.min_lr) * (1 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {schedule.kind!r}")
