"""``sexpgpu checkpoint``: what a checkpoint is, read from its records and tensor headers."""

from __future__ import annotations

import click


@click.command("checkpoint")
@click.argument("location", metavar="<dir|s3://bucket/prefix/step-<n>>")
def checkpoint(location: str) -> None:
    """Print a checkpoint's identity, step and every tensor's name, dtype and shape.

    Reads experiment.json, state.json and the two safetensors headers only (ranged
    reads on a bucket), never tensor data.
    """
    from sexpgpu.checkpoint import describe_checkpoint, open_checkpoint

    storage, key = open_checkpoint(location)
    click.echo(describe_checkpoint(storage, key), nl=False)
