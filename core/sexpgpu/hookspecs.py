"""The hooks a plugin may implement (pluggy project ``sexpgpu``), each described in
docs/plugins.md. Hooks may gain arguments later; they are never renamed.
"""

# No postponed annotations: each hook's return annotation is the type the catalog
# holds its result to (a result of another type refuses the plugin).
from typing import TYPE_CHECKING

import pluggy

from sexpgpu.extension import (
    DataSourceInfo,
    EvalMetricInfo,
    EvaluatorInfo,
    KernelInfo,
    LoweringInfo,
    MetricsSinkInfo,
    OpInfo,
    OptimizerInfo,
    RunOptionInfo,
    SourceOpenerInfo,
    StorageBackendInfo,
)

if TYPE_CHECKING:
    import click

PROJECT = "sexpgpu"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def sexpgpu_lowerings() -> list[LoweringInfo]:
    """Returns lowerings: compilers from a checked program to a trainer. Called when a
    run or an evaluation lowers its program for ``--device``."""


@hookspec
def sexpgpu_kernels() -> list[KernelInfo]:
    """Returns kernels. Called when a lowering chooses one for each choice site."""


@hookspec
def sexpgpu_optimizers() -> list[OptimizerInfo]:
    """Returns optimizers a ``:optimizer`` names. Called when a `.sx` file is compiled
    and when a run builds its optimizer."""


@hookspec
def sexpgpu_storage_backends() -> list[StorageBackendInfo]:
    """Returns storage backends, by URI scheme. Called when a checkpoint location is opened."""


@hookspec
def sexpgpu_metrics_sinks() -> list[MetricsSinkInfo]:
    """Returns metrics sinks. Called when a run opens its metrics stream."""


@hookspec
def sexpgpu_data_sources() -> list[DataSourceInfo]:
    """Returns data sources that ``defdata`` names. Called when a `.sx` file is compiled
    (for shapes) and when a run opens its data."""


@hookspec
def sexpgpu_ops() -> list[OpInfo]:
    """Returns ops of the language, built-in ones included, with their implementations.
    Called when a `.sx` file is compiled and when a lowering builds a program."""


@hookspec
def sexpgpu_evaluators() -> list[EvaluatorInfo]:
    """Returns the runner of a ``defrun``'s ``:evals`` (two across plugins conflict).
    Called when a file with ``:evals`` is compiled, and when a pass is due."""


@hookspec
def sexpgpu_eval_metrics() -> list[EvalMetricInfo]:
    """Returns eval metrics that ``(eval ... :metrics (...))`` may list. Called when a
    file with ``:evals`` is compiled and when a pass reports its numbers."""


@hookspec
def sexpgpu_source_openers() -> list[SourceOpenerInfo]:
    """Returns openers of files that are not `.sx` files, by the end of their name.
    Called when a run is given such a file, before anything is compiled."""


@hookspec
def sexpgpu_run_options() -> list[RunOptionInfo]:
    """Returns options this plugin adds to ``sexpgpu run``, each requesting a recorded
    choice. Called as the CLI starts and when ``sexpgpu run`` parses or shows its help."""


@hookspec
def sexpgpu_cli_commands(cli: "click.Group") -> None:
    """Adds subcommands to ``cli``, the root click group; Returns nothing. Called once
    as the CLI starts: import heavy modules inside the command."""


@hookspec
def sexpgpu_unavailable() -> str | None:
    """Returns why this plugin cannot work here (one line with the install hint), or
    ``None``. Called when the plugin loads; it must not import the missing dependency."""
