"""``sexpgpu runs`` and ``sexpgpu report``: what runs there are, and one run in pictures.

Only click is imported here: the plugin's commands are added to every
``sexpgpu`` invocation, and matplotlib is imported by ``report`` alone.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from sexpgpu_report.listing import RunRow
    from sexpgpu_report.page import Report

METRICS_DIR_OPTION = click.option(
    "--metrics-dir",
    default="./sexpgpu-runs",
    envvar="SEXPGPU_METRICS_DIR",
    show_default=True,
    help="The metrics folder the runs report into (as `sexpgpu run --metrics-dir`).",
)

COLUMNS = ("SLUG", "STATE", "STEP", "LOSS", "EVAL", "CHECKPOINT", "STARTED", "UPDATED", "FILE")


def _when(seconds: float | None) -> str:
    return "-" if seconds is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(seconds))


def _cells(row: RunRow) -> tuple[str, ...]:
    # what a status or events file says is shown escaped: it may hold anything
    from sexpgpu_report.fields import shown

    state = "running (process gone)" if row.process == "gone" else row.state
    step = "-" if row.step is None else str(row.step)
    if row.steps is not None:
        step = f"{step}/{row.steps}"
    evals = " ".join(f"{name}={value:.4g}" for name, value in row.evals.items()) or "-"
    if row.state == "unknown" and row.error:
        evals = row.error  # why the row says nothing more
    return tuple(
        shown(cell)
        for cell in (
            row.slug,
            state,
            step,
            "-" if row.loss is None else f"{row.loss:.4g}",
            evals,
            row.checkpoint or "-",
            _when(row.started),
            _when(row.updated),
            row.file or "-",
        )
    )


def _strict(value: Any) -> Any:
    """``value`` with each NaN or infinite number as ``null``: strict JSON has none."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(r, widths, strict=True)).rstrip()
        for r in rows
    )


@click.command("runs")
@METRICS_DIR_OPTION
@click.option("--json", "as_json", is_flag=True, help="One JSON array of runs, for machines.")
def runs(metrics_dir: str, as_json: bool) -> None:
    """List the runs under the metrics folder, newest first.

    Each run's slug, state (a `running` run whose process is gone, killed
    outright, says so), step of steps, last loss and eval numbers, last
    checkpoint, when it started and was last updated, and its run file. Reads
    only the status files and the ends of the event files.
    """
    from sexpgpu.errors import RunError
    from sexpgpu_report.listing import list_runs

    try:
        found = list_runs(metrics_dir)
    except OSError as exc:
        raise RunError(
            f"cannot list the metrics folder {metrics_dir}: {exc.strerror or exc}",
            code="E-REPORT-001",
        ) from None
    if as_json:
        rows = [_strict(row.as_json()) for row in found]
        click.echo(json.dumps(rows, indent=1, allow_nan=False))
    elif not found:
        click.echo(f"no runs under {metrics_dir}")
    else:
        click.echo(_table([COLUMNS, *(_cells(row) for row in found)]))
        _say_unrecorded([Path(row.folder) for row in found])


def _say_unrecorded(folders: list[Path]) -> None:
    """Say which runs kept no events.jsonl (their metrics sinks were others only, the
    jsonl plugin off), so an empty row or chart is not taken for a run that did nothing."""
    from sexpgpu_report.listing import EVENTS_FILE

    missing = [f.name for f in folders if f.is_dir() and not (f / EVENTS_FILE).exists()]
    if missing:
        click.echo(
            f"no {EVENTS_FILE}, so no numbers shown, for: {', '.join(missing)} "
            "(a run whose metrics went to other sinks only, or that ended before opening them)",
            err=True,
        )


@click.command("report")
@click.argument("run")
@METRICS_DIR_OPTION
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    help="Where the page and the images go (default: <run folder>/report).",
)
@click.option("--watch", is_flag=True, help="Write it again every --interval until the run ends.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.5),
    default=5.0,
    show_default=True,
    help="With --watch: seconds between two writes (the page reloads itself as often).",
)
def report(run: str, metrics_dir: str, out: str | None, watch: bool, interval: float) -> None:
    """Write a report of RUN (a slug under the metrics folder, or a run folder).

    A self-contained HTML page (no network needed to open it) and a PNG per
    chart: loss, learning rate and throughput against step, each eval metric
    per pass, with checkpoints, resumes, interruptions and failures marked.
    Works on a run in progress; with --watch it is written again as the run
    goes, until the run ends or a signal stops it.
    """
    from sexpgpu.errors import RunError
    from sexpgpu_report.listing import resolve_run

    folder = resolve_run(run, metrics_dir)
    if folder is None:
        raise RunError(
            f"no run '{run}': neither a run folder nor a slug under {metrics_dir} "
            "(`sexpgpu runs` lists them)",
            code="E-REPORT-002",
        )
    target = Path(out) if out else folder / "report"
    if watch:
        from sexpgpu_report.watching import watch_report

        code = watch_report(folder, target, interval, write_once)
        if code:
            raise SystemExit(code)
        return
    _say_unrecorded([folder])
    write_once(folder, target, 0.0)


def write_once(folder: Path, target: Path, refresh: float) -> Report:
    """Write the report of ``folder`` into ``target`` and echo its page's path; a folder
    that cannot take it, or events that cannot be read, raise a one-line
    :class:`sexpgpu.errors.RunError`."""
    from sexpgpu.errors import RunError
    from sexpgpu_report.page import write_report
    from sexpgpu_report.series import UnreadableEvents

    try:
        written = write_report(folder, target, refresh=refresh)
    except UnreadableEvents as exc:
        from sexpgpu_report.fields import shown

        raise RunError(
            f"cannot read the run's events: {shown(str(exc))}", code="E-REPORT-004"
        ) from None
    except OSError as exc:
        where = exc.filename or target
        raise RunError(
            f"cannot write the report to {where}: {exc.strerror or exc}", code="E-REPORT-003"
        ) from None
    click.echo(f"{written.page} ({written.charts} charts, {written.marks} annotations)")
    return written
