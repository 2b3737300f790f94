"""``sexpgpu evaluate``: one checkpoint's eval passes, or a run's, followed as it goes."""

from __future__ import annotations

import click

DEFAULT_POLL = 10.0


@click.command("evaluate")
@click.argument("location")
@click.option(
    "--follow",
    is_flag=True,
    help="LOCATION is a checkpoint location: evaluate each new checkpoint until the finished one.",
)
@click.option(
    "--poll",
    type=click.FloatRange(min=0.1, max=3600.0),
    default=DEFAULT_POLL,
    show_default=True,
    help="With --follow: seconds between two listings of the location.",
)
@click.option(
    "--pass",
    "names",
    multiple=True,
    metavar="NAME",
    help="Only this eval pass (repeatable); default every pass.",
)
@click.option("--file", help="The run's .sx file; default the one experiment.json records.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option(
    "--lowering",
    metavar="NAME",
    help="Evaluate with this lowering (torch, compiled, ...) instead of the one the "
    "checkpoint trained with; its kernels are chosen afresh (nothing is written back).",
)
@click.option(
    "--metrics-dir",
    envvar="SEXPGPU_METRICS_DIR",
    help="Where the JSONL sink writes (default ./sexpgpu-runs, as sexpgpu run).",
)
@click.option(
    "--metrics-sink",
    "sinks",
    multiple=True,
    help="A metrics sink besides the run folder's events.jsonl (repeatable), as for run.",
)
@click.option(
    "--settle",
    type=click.FloatRange(min=0.1),
    default=300.0,
    show_default=True,
    help="Seconds a pass's points may take to reach every sink before it is an error.",
)
@click.option(
    "--metrics-wait",
    type=click.FloatRange(min=0),
    default=30.0,
    envvar="SEXPGPU_METRICS_WAIT",
    show_default=True,
    metavar="SECONDS",
    help="At the end, how long to wait for the metrics sinks to take every event; "
    "what they have not taken by then is counted as undelivered.",
)
def evaluate(
    location: str,
    follow: bool,
    poll: float,
    names: tuple[str, ...],
    file: str | None,
    device: str,
    lowering: str | None,
    metrics_dir: str | None,
    sinks: tuple[str, ...],
    settle: float,
    metrics_wait: float,
) -> None:
    """Evaluate a checkpoint's eval passes into its run's metrics experiment.

    LOCATION is a checkpoint (a step-<n> folder, s3://.../step-<n>, gs://...), or
    with --follow a checkpoint location, whose new checkpoints are evaluated as the
    run writes them until the one that finished it; evaluated.json beside them
    says which are done.
    """
    from sexpgpu.catalog import Catalog
    from sexpgpu_eval.session import run_evaluate

    code = run_evaluate(
        location,
        click.get_current_context().find_object(Catalog),
        follow=follow,
        poll=poll,
        names=list(names) or None,
        file=file,
        device=device,
        lowering=lowering,
        metrics_dir=metrics_dir,
        sinks=sinks,
        settle=settle,
        metrics_wait=metrics_wait,
    )
    if code:
        raise SystemExit(code)
