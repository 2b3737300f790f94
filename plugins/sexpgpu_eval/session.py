"""One ``sexpgpu evaluate`` from start to end: what it opens, how it stops, what it prints."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import click

from sexpgpu.catalog import Catalog
from sexpgpu.errors import RunError, UsageError
from sexpgpu.session import CheckpointOpener, evaluator
from sexpgpu.signals import StopWatch, process_watch
from sexpgpu_eval.follow import Evaluation, Reporting, Stopped, follow

DEFAULT_METRICS_DIR = "./sexpgpu-runs"
"""Where the JSONL sink writes unless told (``sexpgpu run``'s default too)."""


def run_evaluate(
    location: str,
    catalog: Catalog,
    *,
    follow: bool,
    poll: float,
    names: list[str] | None,
    file: str | None,
    device: str,
    lowering: str | None = None,
    metrics_dir: str | None,
    sinks: Sequence[str],
    settle: float,
    metrics_wait: float,
) -> int:
    """Evaluate as the command was asked; returns the exit status (``128 + n`` on a
    signal). A user's mistake raises a :class:`sexpgpu.errors.SexpError`, printed as
    ``run`` prints it (``E-CKPT-004`` and ``E-LOAD-001`` list a parameter a line)."""
    watch = process_watch()
    owned = watch is None
    if watch is None:
        watch = StopWatch()
        watch.install()
    reporting = Reporting(
        catalog,
        metrics_dir or DEFAULT_METRICS_DIR,
        tuple(dict.fromkeys(("jsonl", *sinks))),  # the run folder's events.jsonl, as run
        settle,
        metrics_wait,
    )
    try:
        watch.loop_started()  # from here a signal stops at the next batch
        evaluation = Evaluation(
            reader=_Opener(catalog, device=device, file=file, lowering=lowering),
            runner=evaluator(catalog),
            reporting=reporting,
            stopping=lambda: watch.stopping,
            echo=click.echo,
        )
        try:
            if follow:
                _follow(evaluation, location, poll, names)
            else:
                _one(evaluation, location, names)
        except Stopped as stop:
            name, signum = watch.settle()
            reporting.close()
            click.echo(f"sexpgpu evaluate: interrupted by {name} at step {stop.step}", err=True)
            return 128 + signum
        undelivered = reporting.close()
        if undelivered:
            raise RunError(f"{undelivered} metrics events were not delivered")
        return 0
    finally:
        reporting.close()
        watch.ended()
        if owned:
            watch.uninstall()


class _Opener(CheckpointOpener):
    """Opens checkpoints as the session does, saying how to find the run's file when
    the checkpoint's path to it does not lead to it from here."""

    def program(self, experiment: Mapping[str, Any]) -> Any:
        recorded = str(experiment.get("file", ""))
        if self.file is None and recorded and not os.path.isfile(recorded):
            raise UsageError(
                f"the checkpoint's run compiled {recorded}, which is not there from "
                f"{os.getcwd()} (a relative path is the run's folder's); run evaluate from "
                "that folder, or give the file with --file"
            )
        return super().program(experiment)


def _one(evaluation: Evaluation, location: str, names: list[str] | None) -> None:
    storage, key = evaluation.reader.locate(location)
    opened = evaluation.reader.open(storage, key)
    _known(opened.program, names)
    evaluation.evaluate(storage, key, opened, evaluation.passes(opened, names, {}))


def _follow(evaluation: Evaluation, location: str, poll: float, names: list[str] | None) -> None:
    storage = evaluation.reader.catalog.open_location(location)
    storage.list_children("")  # a location that cannot be listed is an error, at once
    followed = follow(evaluation, storage, poll=poll, names=names)
    said = f"sexpgpu evaluate: followed {storage.uri} to its finished step {followed.step}"
    if followed.missed:
        shown = ", ".join(map(str, followed.missed[:10])) + (
            ", ..." if followed.missed[10:] else ""
        )
        said += (
            f"; {len(followed.missed)} due checkpoints were deleted before they were "
            f"evaluated (steps {shown})"
        )
    click.echo(said, err=True)


def _known(program: object, names: list[str] | None) -> None:
    passes = [p.name for p in getattr(program, "evals", ())]
    if not passes:
        raise UsageError("the checkpoint's run has no eval passes (:evals) to evaluate")
    unknown = [name for name in names or () if name not in passes]
    if unknown:
        raise UsageError(
            f"the run has no eval pass '{unknown[0]}'; its passes: {', '.join(passes)}"
        )
