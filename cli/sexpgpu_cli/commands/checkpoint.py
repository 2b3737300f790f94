"""``sexpgpu checkpoint``: what a checkpoint is, read from its records and tensor headers,
or the checkpoints of a location; with ``--verify``, every file's size and CRC32C too.

The core describes a checkpoint as data (:func:`sexpgpu.checkpoint.describe_checkpoint`,
:func:`sexpgpu.checkpoint.list_checkpoints`); the console layout of
docs/checkpoints.md is made here. Every string read from a checkpoint is printed
escaped (:func:`shown`): a forged name cannot move the cursor or forge a line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from sexpgpu.checkpoint import (
        CheckpointDescription,
        CheckpointEntry,
        LoadRecord,
        TensorFile,
    )
    from sexpgpu.checkpoint.verify import FileCheck
    from sexpgpu.extension import Storage

# "precision" and two spaces: the width of the labels in the console layout.
_LABEL = 11
# Source names get 24 columns at least, as in the spec's console example.
_SOURCE_NAME = 24
# The columns of a --verify line: the longest file name, then the longest verdict. Fixed,
# so that each line is printed as soon as its file is read.
_FILE_NAME = len("params.safetensors")
_VERDICT = len("unchecked")

NOT_VERIFIED = (
    f"{'data'.ljust(_LABEL)}not verified: headers only "
    "(--verify reads every file and checks its CRC32C)"
)
"""The last line without ``--verify``: nothing here says the tensor data is intact."""


@click.command("checkpoint")
@click.argument("location", metavar="<dir|s3://bucket/prefix/step-<n>|LOCATION|LOCATION/latest>")
@click.option(
    "--verify",
    is_flag=True,
    help="Also read every file whole (in chunks) and check its size and CRC32C against "
    "experiment.json's record; a file that differs is E-CKPT-006.",
)
def checkpoint(location: str, verify: bool) -> None:
    """Print a checkpoint's identity, step and every tensor's name, dtype and shape;
    on a checkpoint location, list its checkpoints (LOCATION/latest: the newest complete).

    Reads experiment.json, state.json and the two safetensors headers only (ranged
    reads on a bucket), never tensor data, unless --verify. Tensors that disagree with
    experiment.json are flagged with "!" and the command exits 1.
    """
    from sexpgpu.checkpoint import describe_checkpoint, list_checkpoints, open_checkpoint
    from sexpgpu.checkpoint.find import has_checkpoint
    from sexpgpu.errors import UsageError
    from sexpgpu_cli.group import catalog

    storage, key = open_checkpoint(location, catalog().open_location)
    if not key and not has_checkpoint(storage):
        entries = list_checkpoints(storage)
        if entries:
            if verify:
                where = shown(location.rstrip("/"))
                raise UsageError(
                    f"--verify checks one checkpoint and {where} holds {len(entries)}: name "
                    f"one ({where}/step-<n>, or {where}/latest for the newest complete one)"
                )
            click.echo(render_listing(storage.uri, entries), nl=False)
            return
    description = describe_checkpoint(storage, key)
    click.echo(render_checkpoint(description), nl=False)
    checks = _verify(storage, key) if verify else None
    if checks is None:
        click.echo(NOT_VERIFIED)
    _refuse_problems(description)
    if checks is not None:
        _refuse_damage(checks)


def _verify(storage: Storage, key: str) -> list[FileCheck]:
    """Check every file's size and CRC32C, printing each file's line once it is read."""
    from sexpgpu.checkpoint.verify import verify_checkpoint

    click.echo("checksums")
    checks = []
    for check in verify_checkpoint(storage, key):
        click.echo(check_line(check))
        checks.append(check)
    click.echo(verdict_line(checks))
    return checks


def _refuse_problems(description: CheckpointDescription) -> None:
    """Exit 1 when the headers disagree with experiment.json, as a resume would refuse them."""
    from sexpgpu.checkpoint import E_DAMAGED, E_FOREIGN
    from sexpgpu.errors import CheckpointError

    if not description.problems:
        return
    count = len(description.problems)
    flagged = f"{count} problem{'s' if count != 1 else ''}, flagged with ! above"
    if description.foreign is not None:  # as a resume says it: one damage, one code
        raise CheckpointError(
            f"{shown(description.location)}/{shown(description.foreign)} ({flagged})",
            code=E_FOREIGN,
        )
    raise CheckpointError(
        f"{shown(description.location)}: the tensor files disagree with experiment.json "
        f"({flagged})",
        code=E_DAMAGED,
    )


def _refuse_damage(checks: list[FileCheck]) -> None:
    """Exit 1 with a resume's E-CKPT-006 line for the first damaged file, if any."""
    from sexpgpu.checkpoint.integrity import not_written

    damaged = [(check.location, check.damage) for check in checks if check.damage is not None]
    if not damaged:
        return
    location, said = damaged[0]
    if len(damaged) > 1:
        said += f" ({len(damaged) - 1} more damaged, flagged with ! above)"
    raise not_written(shown(location), said)


def check_line(check: FileCheck) -> str:
    """One file's line under ``checksums``: verified with its size and CRC32C, its
    damage (flagged with ``!``), or unchecked when ``experiment.json`` records nothing."""
    if check.recorded is None:
        verdict, said = "unchecked", "experiment.json records no size or CRC32C of it"
    elif check.damage is not None:
        verdict, said = "damaged", check.damage
    else:
        verdict, said = "verified", f"{check.size} bytes, CRC32C {check.crc32c}"
    flag = "! " if check.damage is not None else "  "
    return f"{flag}{check.name.ljust(_FILE_NAME)}  {verdict.ljust(_VERDICT)}  {shown(said)}"


def verdict_line(checks: list[FileCheck]) -> str:
    """The line after the files: whether the data is the data the checkpoint wrote."""
    damaged = sum(check.damage is not None for check in checks)
    verified = sum(check.verified for check in checks)
    if damaged:
        said = f"damaged: {damaged} of {len(checks)} files are not the ones its checkpoint wrote"
        if damaged == 1:
            said = f"damaged: 1 of {len(checks)} files is not the one its checkpoint wrote"
    elif verified == len(checks):
        said = "verified: every file has the size and CRC32C experiment.json records"
    elif verified == 0:
        said = "not verified: experiment.json records no checksums (written before them)"
    else:
        said = (
            f"verified in part: {verified} of {len(checks)} files; experiment.json records "
            "no checksum of the others"
        )
    return f"{'data'.ljust(_LABEL)}{said}"


def shown(value: object) -> str:
    """``value`` as text safe on a terminal: control characters (escape sequences,
    newlines, carriage returns) and other unprintable ones written as escapes."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def render_listing(uri: str, entries: list[CheckpointEntry]) -> str:
    """What ``sexpgpu checkpoint LOCATION`` prints: one line per ``step-<n>``, oldest first."""
    import datetime

    rows = [("step", "complete", "finished", "size", "written")]
    problems = []
    for e in entries:
        when = "-"
        if e.written is not None:
            moment = datetime.datetime.fromtimestamp(e.written, tz=datetime.timezone.utc)
            when = moment.strftime("%Y-%m-%d %H:%M:%S UTC")
        finished = "-" if e.finished is None else ("true" if e.finished else "false")
        if e.problem is not None:
            finished = "?"
            problems.append(f"! {e.key}: {shown(e.problem)}")
        complete = {True: "yes", False: "no (cut off)", None: "?"}[e.complete]
        size = "-" if e.size is None else _size(e.size)
        rows.append((str(e.step), complete, finished, size, when))
    return "\n".join([f"checkpoints in {shown(uri)}", *_table(rows), *problems]) + "\n"


def _size(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def render_checkpoint(description: CheckpointDescription) -> str:
    """What ``sexpgpu checkpoint`` prints for ``description``, every line ending in a newline."""
    from sexpgpu.checkpoint import value_text

    d = description
    devices = str(d.devices) + (f" on {d.nodes} nodes" if d.nodes != 1 else "")
    lines = [f"checkpoint {shown(d.location)}"]
    for label, value in (
        ("step", d.step),
        ("sexpgpu", d.sexpgpu),
        ("variant", d.variant),
        ("devices", devices),
        ("precision", d.precision),
        ("seed", d.seed),
        ("counters", ", ".join(d.counters) or "-"),
    ):
        lines.append(f"{label.ljust(_LABEL)}{shown(value)}")
    lines.append("sources")
    lines += _table([(s.name, s.sha256) for s in d.sources], least=_SOURCE_NAME)
    lines.append(f"{'slug'.ljust(_LABEL)}{shown(d.slug)}")
    lines.append(f"{'finished'.ljust(_LABEL)}{'true' if d.finished else 'false'}")
    lines.append("knobs")
    lines += _table([(k.name, value_text(k.value), k.source) for k in d.knobs])
    lines.append("choices")
    lines += _table(list(d.choices))
    lines.append("loaded")
    lines += _table([(load.path, _load_text(load)) for load in d.loaded])
    for file in d.files:
        lines += _tensor_lines(file)
    lines += [f"! {shown(problem)}" for problem in d.problems]
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
    lines = []
    rows = [tuple(shown(cell) for cell in row) for row in rows]
    widths = [max(least, *(len(row[i]) for row in rows)) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)]
        lines.append((indent + "  ".join([*cells, row[-1]])).rstrip())
    return lines
