"""``sexpgpu run``: train a `.sx` file, checkpointing and resuming as the spec says."""

from __future__ import annotations

import sys
from typing import Any

import click

from sexpgpu_cli.group import catalog
from sexpgpu_cli.options import parse_sets
from sexpgpu_cli.run_options import RunCommand, requested


# The plugins add their own options (the torch lowerings' --threads and --shard),
# each requesting a recorded choice: sexpgpu_cli.run_options.
@click.command("run", cls=RunCommand)
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--set", "sets", multiple=True, metavar="NAME=VALUE", help="Set a knob (repeatable).")
@click.option("--steps", type=click.IntRange(min=1), help="Set the knob `steps`.")
@click.option("--variant", help="Take a variant's knob values.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option(
    "--devices",
    type=click.IntRange(min=1),
    help="Train data-parallel on N devices of this machine (N workers through torch's "
    "launcher; :batch is the global batch). Recorded; a resume needs the same count.",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="With --devices: restart the group this many times when a worker dies "
    "(with --resume latest, from the newest checkpoint).",
)
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
    help="A metrics sink to report to besides the run folder's events.jsonl, which is "
    "always kept (repeatable); see `sexpgpu plugins`.",
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
    help="On resume, take the checkpoint's recorded choices (kernels, CPU threads...), "
    "or choose again.",
)
@click.option(
    "--lowering",
    metavar="NAME",
    help="The lowering by name, e.g. torch (eager) or compiled (torch.compile); default: "
    "the device's (torch on cpu, compiled on cuda). Recorded, and pinned on resume.",
)
@click.option(
    "--choose",
    "requests",
    multiple=True,
    metavar="SITE=KERNEL",
    help="Take KERNEL at a choice site (repeatable): a site's full name, e.g. "
    "attention:model.blocks.attn, or a kind (attention, stack, conv2d) for all its "
    "sites; a full name wins over its kind. `sexpgpu check FILE` lists the sites and "
    "kernels. Recorded, and pinned on resume.",
)
@click.option(
    "--keep-last",
    type=click.IntRange(min=1),
    help="Keep only the newest N complete checkpoints (wins over the file's :keep-last).",
)
@click.option(
    "--log-every",
    default="30s",
    show_default=True,
    metavar="N|Ns|N,Ms",
    help="Off a terminal, log a step line every N steps and/or every N seconds.",
)
def run(
    file: str,
    sets: tuple[str, ...],
    steps: int | None,
    variant: str | None,
    device: str,
    devices: int | None,
    max_restarts: int,
    metrics_dir: str,
    metrics_sinks: tuple[str, ...],
    metrics_wait: float,
    checkpoint_dir: str | None,
    resume: str | None,
    choices: str,
    lowering: str | None,
    requests: tuple[str, ...],
    keep_last: int | None,
    log_every: str,
    **plugin_options: Any,
) -> None:
    """Train FILE, checkpointing to --checkpoint-dir and resuming with --resume."""
    from sexpgpu.opening import Selection, Target, parse_requests, prepare_environment
    from sexpgpu_cli.launch import Worker, in_worker, launch, launcher_for
    from sexpgpu_cli.options import metrics_sinks as sinks_of
    from sexpgpu_cli.reporting import LogEvery, Reporter
    from sexpgpu_cli.slurm import take_srun_environment

    choose = parse_requests(requests)  # a malformed one is refused before any worker starts
    take_srun_environment()  # a task srun started is a rank, as a torchrun worker is
    every = LogEvery.parse(log_every)
    asked, flags = requested(click.get_current_context(), plugin_options)
    target = Target(
        device=device,
        lowering=lowering or None,
        choose=choose,
        requests=asked,
        options=flags,
        fresh=choices == "fresh",
    )
    worker = Worker(devices) if in_worker() else None
    if worker is None and ((devices or 1) > 1 or max_restarts):
        start = launcher_for(catalog(), target)  # LoweringInfo.launch of the run's lowering
        sys.exit(
            launch(
                sys.argv[1:],
                devices=devices or 1,
                max_restarts=max_restarts,
                device=device,
                start=start,
            )
        )
    selection = Selection(file, sets=parse_sets(sets), variant=variant, steps=steps)
    selection = selection.opened(catalog(), fresh=target.fresh)  # a bundle: unpacked, checked
    # First, before torch is imported: ATen and OpenMP read their settings when they start.
    prepare_environment(
        catalog(), selection, target, resume=resume or None, checkpoint_dir=checkpoint_dir or None
    )
    from sexpgpu.train import RunOptions
    from sexpgpu.train import run as run_file

    def reporter(total: int, step: int, tokens: int | None) -> Reporter:
        return Reporter(total=total, step=step, every=every, terminal=True, tokens=tokens)

    options = RunOptions(
        selection=selection,
        target=target,
        metrics_dir=metrics_dir,
        metrics_sinks=sinks_of(catalog(), metrics_sinks),
        metrics_wait=metrics_wait,
        checkpoint_dir=checkpoint_dir or None,
        resume=resume or None,
        keep_last=keep_last,
        reporter=reporter,
    )
    if worker is not None:
        outcome = worker.run(options, catalog())
    else:
        outcome = run_file(options, catalog())
    code, message = outcome.exit_code, outcome.message
    if worker is not None:
        code, message = worker.finish(code, message, outcome.code)
    if message:
        click.echo(f"sexpgpu run: {message}", err=True)
    sys.exit(code)
