"""``sexpgpu run``: train a `.sx` file, checkpointing and resuming as the spec says."""

from __future__ import annotations

import sys

import click

from sexpgpu_cli.options import parse_sets


@click.command("run")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--set", "sets", multiple=True, metavar="NAME=VALUE", help="Set a knob (repeatable).")
@click.option("--steps", type=click.IntRange(min=0), help="Set the knob `steps`.")
@click.option("--variant", help="Take a variant's knob values.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option(
    "--metrics-dir",
    default="./sexpgpu-runs",
    envvar="SEXPGPU_METRICS_DIR",
    show_default=True,
    help="Where metrics and the status file go (<dir>/<slug>/).",
)
@click.option(
    "--metrics-sink",
    "metrics_sinks",
    multiple=True,
    default=("jsonl",),
    show_default=True,
    help="A metrics sink by name (repeatable); see `sexpgpu plugins`.",
)
@click.option(
    "--checkpoint-dir",
    envvar="SEXPGPU_CHECKPOINT_DIR",
    help="Checkpoint location: a folder, file://, s3:// or gs://. Without it nothing is written.",
)
@click.option(
    "--resume",
    envvar="SEXPGPU_RESUME",
    help="`latest` (newest complete checkpoint, or a fresh start) or a checkpoint's location.",
)
@click.option(
    "--choices",
    type=click.Choice(["pinned", "fresh"]),
    default="pinned",
    show_default=True,
    help="On resume, take the checkpoint's recorded kernel choices, or choose again.",
)
def run(
    file: str,
    sets: tuple[str, ...],
    steps: int | None,
    variant: str | None,
    device: str,
    metrics_dir: str,
    metrics_sinks: tuple[str, ...],
    checkpoint_dir: str | None,
    resume: str | None,
    choices: str,
) -> None:
    """Train FILE, checkpointing to --checkpoint-dir and resuming with --resume."""
    from sexpgpu.run import RunOptions
    from sexpgpu.run import run as run_file

    outcome = run_file(
        RunOptions(
            file=file,
            sets=parse_sets(sets),
            variant=variant,
            steps=steps,
            device=device,
            metrics_dir=metrics_dir,
            metrics_sinks=tuple(metrics_sinks),
            checkpoint_dir=checkpoint_dir or None,
            resume=resume or None,
            fresh_choices=choices == "fresh",
            progress=True,
        )
    )
    if outcome.message:
        click.echo(f"sexpgpu run: {outcome.message}", err=True)
    sys.exit(outcome.exit_code)
