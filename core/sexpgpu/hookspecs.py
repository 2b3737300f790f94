"""The hooks a plugin may implement (pluggy project ``sexpgpu``).

Every hook that supplies things returns a list of descriptors from
:mod:`sexpgpu.extension`. Descriptors are cheap to build: anything heavy (torch,
boto3, google-cloud-storage) is imported by the descriptor's ``factory`` only
when the thing is used, so ``sexpgpu --help`` and ``sexpgpu plugins`` stay fast.
Hooks may gain arguments later; they are never renamed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import click

    from sexpgpu.extension import (
        DataSourceInfo,
        EvalMetricInfo,
        EvaluatorInfo,
        KernelInfo,
        LoweringInfo,
        MetricsSinkInfo,
        OpInfo,
        OptimizerInfo,
        StorageBackendInfo,
    )

PROJECT = "sexpgpu"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def sexpgpu_lowerings() -> list[LoweringInfo]:
    """Supply lowerings: compilers from a checked program to something that trains.

    Receives nothing. Returns a list of :class:`sexpgpu.extension.LoweringInfo`,
    each naming the device kinds it serves (``cpu``, ``cuda``). Called when a run
    or an evaluation picks how to execute its program on ``--device``.
    """


@hookspec
def sexpgpu_kernels() -> list[KernelInfo]:
    """Supply kernels: alternative implementations of one kind of choice site.

    Receives nothing. Returns a list of :class:`sexpgpu.extension.KernelInfo`
    (kind such as ``attention`` or ``stack``, a name recorded as the choice, the
    lowering and devices it runs on, whether it is deterministic). Called when
    a lowering chooses an implementation for each choice site of a program.
    """


@hookspec
def sexpgpu_optimizers() -> list[OptimizerInfo]:
    """Supply named optimizers usable in a ``defrun``'s ``:optimizer``.

    Receives nothing. Returns a list of :class:`sexpgpu.extension.OptimizerInfo`
    (name, options with defaults, the state names it keeps per parameter, and a
    factory for its propose-then-commit update). Called when a `.sx` file is
    compiled (to check options) and when a run builds its optimizer.
    """


@hookspec
def sexpgpu_storage_backends() -> list[StorageBackendInfo]:
    """Supply storage backends for checkpoint locations, one or more URI schemes each.

    Receives nothing. Returns a list of :class:`sexpgpu.extension.StorageBackendInfo`.
    Called when a location such as ``/tmp/run``, ``file://...``, ``s3://...`` or
    ``gs://...`` is opened.
    """


@hookspec
def sexpgpu_metrics_sinks() -> list[MetricsSinkInfo]:
    """Supply metrics sinks: places the metrics stream of a run is written to.

    Receives nothing. Returns a list of :class:`sexpgpu.extension.MetricsSinkInfo`.
    Called when a run opens its metrics stream; every sink named by
    ``--metrics-sink`` (default ``jsonl``) receives every event.
    """


@hookspec
def sexpgpu_data_sources() -> list[DataSourceInfo]:
    """Supply data sources that ``defdata`` forms can name.

    Receives nothing. Returns a list of :class:`sexpgpu.extension.DataSourceInfo`
    (name, options with defaults, a torch-free function giving the batch's
    fields and shapes, and a factory for the loader). Called when a `.sx` file is
    compiled (for shapes) and when a run opens its data.
    """


@hookspec
def sexpgpu_ops() -> list[OpInfo]:
    """Supply ops of the language: what a `.sx` expression may call inline.

    Receives nothing. Returns a list of :class:`sexpgpu.extension.OpInfo`, each
    with the op's spec (arguments, keywords, shape and dtype inference, a doc
    line) and its implementation for each lowering that can run it. Called
    when a `.sx` file is compiled (the spec) and when a lowering builds a
    program that uses the op (the implementation). Built-in ops are supplied
    the same way.
    """


@hookspec
def sexpgpu_evaluators() -> list[EvaluatorInfo]:
    """Supply the eval-pass runner that runs a ``defrun``'s ``:evals``.

    Receives nothing. Returns a list of :class:`sexpgpu.extension.EvaluatorInfo`
    (one at most across plugins: two are a conflict). Called when a `.sx` file
    with ``:evals`` is compiled (to check that passes can run) and when a run or
    ``sexpgpu evaluate`` reaches a pass's step.
    """


@hookspec
def sexpgpu_eval_metrics() -> list[EvalMetricInfo]:
    """Supply named eval metrics that ``(eval ... :metrics (...))`` may list.

    Receives nothing. Returns a list of :class:`sexpgpu.extension.EvalMetricInfo`
    (a name, a `.sx` expression over ``logits``, ``targets`` and ``loss`` giving
    one scalar per batch, and how the mean over the pass's batches becomes the
    number). Called when a `.sx` file with ``:evals`` is compiled and when a
    pass reports its numbers.
    """


@hookspec
def sexpgpu_cli_commands(cli: click.Group) -> None:
    """Add subcommands to the ``sexpgpu`` command line.

    Receives the root click group; call ``cli.add_command(...)``. Returns
    nothing. Called once when the CLI starts, so keep it cheap: import heavy
    modules inside the command's function, not at the top of the plugin.
    """


@hookspec
def sexpgpu_unavailable() -> str | None:
    """Say why this plugin cannot work here, or ``None`` when it can.

    Receives nothing. Returns a one-line reason with the install hint (for
    example ``boto3 is not installed: pip install 'sexpgpu[s3]'``). Called by
    ``sexpgpu plugins`` and before anything a plugin supplies is used; must not
    import the missing dependency to find out (use ``importlib.util.find_spec``).
    """
