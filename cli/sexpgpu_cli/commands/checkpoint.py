"""``sexpgpu checkpoint``: what a checkpoint is, read from its records and tensor headers.

The core describes a checkpoint as data (:func:`sexpgpu.checkpoint.describe_checkpoint`);
the console layout of docs/checkpoints.md is made here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from sexpgpu.checkpoint import CheckpointDescription, LoadRecord, TensorFile

# "precision" and two spaces: the width of the labels in the console layout.
_LABEL = 11
# Source names get 24 columns at least, as in the spec's console example.
_SOURCE_NAME = 24


@click.command("checkpoint")
@click.argument("location", metavar="<dir|s3://bucket/prefix/step-<n>>")
def checkpoint(location: str) -> None:
    """Print a checkpoint's identity, step and every tensor's name, dtype and shape.

    Reads experiment.json, state.json and the two safetensors headers only (ranged
    reads on a bucket), never tensor data.
    """
    from sexpgpu.checkpoint import describe_checkpoint, open_checkpoint

    storage, key = open_checkpoint(location)
    click.echo(render_checkpoint(describe_checkpoint(storage, key)), nl=False)


def render_checkpoint(description: CheckpointDescription) -> str:
    """What ``sexpgpu checkpoint`` prints for ``description``, every line ending in a newline."""
    from sexpgpu.checkpoint import value_text

    d = description
    devices = str(d.devices) + (f" on {d.nodes} nodes" if d.nodes != 1 else "")
    lines = [f"checkpoint {d.location}"]
    for label, value in (
        ("step", d.step),
        ("sexpgpu", d.sexpgpu),
        ("variant", d.variant),
        ("devices", devices),
        ("precision", d.precision),
        ("seed", d.seed),
        ("counters", ", ".join(d.counters) or "-"),
    ):
        lines.append(f"{label.ljust(_LABEL)}{value}")
    lines.append("sources")
    lines += _table([(s.name, s.sha256) for s in d.sources], least=_SOURCE_NAME)
    lines.append(f"{'slug'.ljust(_LABEL)}{d.slug}")
    lines.append(f"{'finished'.ljust(_LABEL)}{'true' if d.finished else 'false'}")
    lines.append("knobs")
    lines += _table([(k.name, value_text(k.value), k.source) for k in d.knobs])
    lines.append("choices")
    lines += _table(list(d.choices))
    lines.append("loaded")
    lines += _table([(load.path, _load_text(load)) for load in d.loaded])
    for file in d.files:
        lines += _tensor_lines(file)
    return "\n".join(lines) + "\n"


def _load_text(load: LoadRecord) -> str:
    text = f"{load.tensor} in {load.uri}"
    if load.size is not None:
        text += f", {load.size} bytes"
    if load.version is not None:
        text += f", {_version(load.version)}"
    return text


def _tensor_lines(file: TensorFile) -> list[str]:
    from sexpgpu.checkpoint import shape_text

    count = len(file.tensors)
    rows = []
    for tensor in file.tensors:
        suffix = ["frozen"] if tensor.frozen else []
        if tensor.tags:
            suffix.append(", ".join(tensor.tags))
        rows.append((tensor.name, tensor.dtype, "  ".join([shape_text(tensor.shape), *suffix])))
    return [f"{file.name}  {count} tensor{'' if count == 1 else 's'}", *_table(rows)]


def _version(version: str) -> str:
    # A local file's sha256 is told by its first 8 hex digits, as git tells commits.
    if version.startswith("sha256:") and len(version) > 15:
        return version[:15] + "..."
    return version


def _table(rows: list[tuple[str, ...]], indent: str = "  ", least: int = 0) -> list[str]:
    """Rows with every column but the last padded to its widest cell (at least
    ``least`` wide) plus two spaces."""
    if not rows:
        return []
    widths = [max(least, *(len(row[i]) for row in rows)) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)]
        lines.append((indent + "  ".join([*cells, row[-1]])).rstrip())
    return lines
