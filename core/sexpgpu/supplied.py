"""What a run takes from the plugins: its program lowered, its data, the eval runner
and the optimizers, each the available plugin's under the core's rules (a name
asked for, a pinned choice, a device kind's default; E-PLUGIN-001 on a conflict).
``sexpgpu run`` and ``sexpgpu evaluate`` both take them from here."""

from __future__ import annotations

from collections.abc import Mapping

from sexpgpu.extension import DataLoader, DataSourceInfo, Evaluator, OptimizerInfo, Trainer
from sexpgpu.graph import DataDecl, Program
from sexpgpu.plugins import get_plugins

__all__ = ["eval_runner", "lower_program", "open_data", "optimizers_available"]


def lower_program(
    program: Program,
    *,
    device: str = "cpu",
    pinned: Mapping[str, str] | None = None,
    lowering: str | None = None,
    choose: Mapping[str, str] | None = None,
) -> Trainer:
    """Lower ``program`` for ``device`` as a run does: the lowering named by
    ``lowering`` or by the pinned choice, else the device kind's default; every
    available kernel and optimizer, ``pinned`` choices taken, and the kernels
    ``choose`` asks for (``--choose``: ``{site or kind: kernel}``, handed to the
    lowering with the pins; see :func:`sexpgpu.kernels.pin_requests`). The
    lowering's name is recorded in the trainer's ``choices`` (``lowering``)."""
    from sexpgpu.kernels import LOWERING_CHOICE, choose_lowering, pin_requests
    from sexpgpu.plugin_supplies import defaults_of

    pinned = pin_requests(program, choose, pinned)
    kind = device.split(":", 1)[0]
    plugins = get_plugins()
    lowerings = plugins.available("sexpgpu_lowerings")
    info = choose_lowering(lowerings, device=device, requested=lowering, pinned=pinned)
    if info is None:
        # the kind's default; with none available, the one lowering that serves it
        defaulted = any(kind in defaults_of(item) for item in lowerings)
        info = plugins.require(
            "sexpgpu_lowerings",
            f"the device '{device}'",
            lambda item: kind in (defaults_of(item) if defaulted else item.devices),
        )
    trainer = info.factory().lower(
        program,
        device=device,
        kernels=plugins.available("sexpgpu_kernels"),
        optimizers=optimizers_available(),
        pinned=pinned,
    )
    trainer.choices[LOWERING_CHOICE] = info.name  # type: ignore[index]
    return trainer


def open_data(decl: DataDecl, seed: int) -> tuple[DataSourceInfo, DataLoader]:
    """The data source a ``defdata`` names, and a loader opened on it from ``seed``."""
    info = get_plugins().require(
        "sexpgpu_data_sources", f"the data source '{decl.source}'", lambda i: i.name == decl.source
    )
    return info, info.factory(decl.options, decl.seq, decl.batch, seed)


def eval_runner() -> Evaluator:
    """The eval-pass runner an available plugin supplies, given every available eval
    metric: what a run calls at a pass's steps, and ``sexpgpu evaluate`` too."""
    plugins = get_plugins()
    info = plugins.require("sexpgpu_evaluators", "eval passes (:evals)", lambda item: True)
    metrics = {metric.name: metric for metric in plugins.available("sexpgpu_eval_metrics")}
    return info.factory(metrics)


def optimizers_available() -> dict[str, OptimizerInfo]:
    """Every available optimizer, by name."""
    return {info.name: info for info in get_plugins().available("sexpgpu_optimizers")}
