"""The hooks a plugin may implement (pluggy project ``sexpgpu``).

Every hook that supplies things returns a list of descriptors from
:mod:`sexpgpu.extension`. Descriptors are cheap to build: anything heavy (torch,
boto3, google-cloud-storage) is imported by the descriptor's ``factory`` only
when the thing is used, so ``sexpgpu --help`` and ``sexpgpu plugins`` stay fast.
Hooks may gain arguments later; they are never renamed.
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
    """Returns lowerings (:class:`~sexpgpu.extension.LoweringInfo`): compilers from a
    checked program to something that trains, each naming the device kinds it serves.
    Called when a run or an evaluation lowers its program for ``--device``."""


@hookspec
def sexpgpu_kernels() -> list[KernelInfo]:
    """Returns kernels (:class:`~sexpgpu.extension.KernelInfo`): implementations of one
    kind of choice site (``attention``, ``stack``). Called when a lowering chooses one
    for each choice site of a program."""


@hookspec
def sexpgpu_optimizers() -> list[OptimizerInfo]:
    """Returns optimizers (:class:`~sexpgpu.extension.OptimizerInfo`) a ``:optimizer``
    names. Called when a `.sx` file is compiled (to check options) and when a run
    builds its optimizer."""


@hookspec
def sexpgpu_storage_backends() -> list[StorageBackendInfo]:
    """Returns storage backends (:class:`~sexpgpu.extension.StorageBackendInfo`) for
    checkpoint locations, one or more URI schemes each. Called when a location
    (``/tmp/run``, ``s3://...``, ``gs://...``) is opened."""


@hookspec
def sexpgpu_metrics_sinks() -> list[MetricsSinkInfo]:
    """Returns metrics sinks (:class:`~sexpgpu.extension.MetricsSinkInfo`), places a
    run's metrics stream is written to. Called when a run opens its stream; each sink
    ``--metrics-sink`` names receives every event."""


@hookspec
def sexpgpu_data_sources() -> list[DataSourceInfo]:
    """Returns data sources (:class:`~sexpgpu.extension.DataSourceInfo`) that ``defdata``
    names. Called when a `.sx` file is compiled (for shapes) and when a run opens its data."""


@hookspec
def sexpgpu_ops() -> list[OpInfo]:
    """Returns ops of the language (:class:`~sexpgpu.extension.OpInfo`): each op's spec
    and its implementation for each lowering that runs it (built-in ops come the same
    way). Called when a `.sx` file is compiled and when a lowering builds a program."""


@hookspec
def sexpgpu_evaluators() -> list[EvaluatorInfo]:
    """Returns the runner of a ``defrun``'s ``:evals``
    (:class:`~sexpgpu.extension.EvaluatorInfo`; two across plugins are a conflict).
    Called when a file with ``:evals`` is compiled, and when a pass is due."""


@hookspec
def sexpgpu_eval_metrics() -> list[EvalMetricInfo]:
    """Returns named eval metrics (:class:`~sexpgpu.extension.EvalMetricInfo`) that
    ``(eval ... :metrics (...))`` may list. Called when a file with ``:evals`` is
    compiled and when a pass reports its numbers."""


@hookspec
def sexpgpu_source_openers() -> list[SourceOpenerInfo]:
    """Returns openers of files that are not `.sx` files
    (:class:`~sexpgpu.extension.SourceOpenerInfo`), each told by the end of a file's
    name (``.sxb``: a bundle). Called when ``sexpgpu run`` or ``sexpgpu.train.run`` is
    given such a file, before anything is compiled."""


@hookspec
def sexpgpu_run_options() -> list[RunOptionInfo]:
    """Returns options this plugin adds to ``sexpgpu run``
    (:class:`~sexpgpu.extension.RunOptionInfo`), each requesting a recorded choice
    (``--threads N``: ``cpu.threads``). Called as the CLI starts and when ``sexpgpu
    run`` parses its command line or shows its help: build no click object here."""


@hookspec
def sexpgpu_cli_commands(cli: "click.Group") -> None:
    """Adds subcommands to ``cli``, the root click group (``cli.add_command``); Returns
    nothing. Called once as the CLI starts: import heavy modules inside the command."""


@hookspec
def sexpgpu_unavailable() -> str | None:
    """Returns why this plugin cannot work here, one line with the install hint, or
    ``None`` when it can. Called by ``sexpgpu plugins`` and before anything it supplies
    is used; it must not import the missing dependency (``importlib.util.find_spec``)."""
