"""The evaluation plugin: the eval passes a run executes (``:evals``), the eval
metrics they compute, and ``sexpgpu evaluate``.

Written as a third party would write it: only the core's public API
(``sexpgpu.extension.PUBLIC_API``). Torch is never imported here; the passes run
on whatever trainer the run's lowering built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sexpgpu.extension import EvalMetricInfo, EvaluatorInfo, OpInfo
from sexpgpu.hookspecs import hookimpl

if TYPE_CHECKING:
    import click


def _runner(metrics):  # type: ignore[no-untyped-def]
    from sexpgpu_eval.passes import PassRunner

    return PassRunner(metrics)


@hookimpl
def sexpgpu_evaluators() -> list[EvaluatorInfo]:
    """The eval-pass runner a run and ``sexpgpu evaluate`` call."""
    return [
        EvaluatorInfo(
            name="passes",
            factory=_runner,
            doc="runs a pass over its batches of its own data stream (seed + 1), mean per metric",
        )
    ]


@hookimpl
def sexpgpu_eval_metrics() -> list[EvalMetricInfo]:
    """``loss``, ``accuracy``, ``perplexity``, ``bits-per-char``, ``top-k-accuracy``."""
    from sexpgpu_eval.metrics import BUILT_IN

    return list(BUILT_IN)


@hookimpl
def sexpgpu_ops() -> list[OpInfo]:
    """``top-k-accuracy``, which the metric of that name computes."""
    from sexpgpu_eval.metrics import TOP_K_OP

    return [TOP_K_OP]


@hookimpl
def sexpgpu_cli_commands(cli: click.Group) -> None:
    """``sexpgpu evaluate``."""
    from sexpgpu_eval.command import evaluate

    cli.add_command(evaluate)
