"""Listing a checkpoint location: each ``step-<n>`` folder, complete or cut off, read
from its ``experiment.json`` only (what ``sexpgpu checkpoint LOCATION`` shows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sexpgpu.checkpoint.find import steps_of
from sexpgpu.checkpoint.keys import EXPERIMENT_FILE, file_key
from sexpgpu.checkpoint.read import read_experiment_bytes
from sexpgpu.errors import CheckpointError, StorageError

if TYPE_CHECKING:
    from sexpgpu.extension import Storage


@dataclass(frozen=True)
class CheckpointEntry:
    """One ``step-<n>`` folder of a checkpoint location, as ``sexpgpu checkpoint LOCATION``
    lists it: whether it is complete, and for a complete one whether it is the run's
    last (``finished``), its size in bytes and when it was written (unix seconds),
    when its ``experiment.json`` records them, or why that record cannot be read."""

    step: int
    key: str
    complete: bool | None
    """Whether its ``experiment.json`` is there; ``None`` when the folder cannot be read."""
    finished: bool | None = None
    size: int | None = None
    written: float | None = None
    problem: str | None = None


def list_checkpoints(storage: Storage) -> list[CheckpointEntry]:
    """Every ``step-<n>`` folder under the location, oldest first, each read from its
    ``experiment.json`` only (never a tensor file)."""
    entries = []
    for step, key in steps_of(storage):
        try:
            complete = storage.exists(file_key(key, EXPERIMENT_FILE))
        except StorageError as error:  # a folder that cannot be read: complete or not, unknown
            entries.append(CheckpointEntry(step, key, complete=None, problem=error.render()))
            continue
        if not complete:
            entries.append(CheckpointEntry(step, key, complete=False))
            continue
        try:
            experiment, data = read_experiment_bytes(storage, key)
        except (CheckpointError, StorageError) as error:
            entries.append(CheckpointEntry(step, key, complete=True, problem=error.render()))
            continue
        files = experiment.get("files")
        size = None
        if files is not None:
            size = sum(record["size"] for record in files.values()) + len(data)
        entries.append(
            CheckpointEntry(
                step,
                key,
                complete=True,
                finished=bool(experiment.get("finished")),
                size=size,
                written=experiment.get("written"),
            )
        )
    return entries
