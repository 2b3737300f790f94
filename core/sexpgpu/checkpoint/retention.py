"""Retention (``:keep-last N``): which checkpoints a location holds, and deleting the old ones.

A checkpoint counts only once its ``experiment.json`` exists, so deleting one
removes ``experiment.json`` first and the rest after it: a deletion cut off
half way (a ``kill -9``, a machine gone) leaves a folder that no reader takes
for a checkpoint, and ``--resume latest`` passes over it as it passes over a
write cut off. Only complete checkpoints are ever deleted: a folder without
``experiment.json`` may be one being written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sexpgpu.checkpoint.find import steps_of
from sexpgpu.checkpoint.keys import EXPERIMENT_FILE, FILES, file_key

if TYPE_CHECKING:
    from sexpgpu.extension import Storage

__all__ = ["StepFolder", "delete_checkpoint", "list_steps", "prune"]


@dataclass(frozen=True)
class StepFolder:
    """One ``step-<n>`` folder under a checkpoint location."""

    step: int
    key: str
    complete: bool
    """Whether it holds ``experiment.json`` (only then is it a checkpoint)."""


def list_steps(storage: Storage) -> list[StepFolder]:
    """Every ``step-<n>`` folder under ``storage``, lowest step first.

    Other names are ignored. A location that cannot be listed raises
    :class:`sexpgpu.errors.StorageError`.
    """
    return [
        StepFolder(step, key, storage.exists(file_key(key, EXPERIMENT_FILE)))
        for step, key in steps_of(storage)
    ]


def delete_checkpoint(storage: Storage, key: str) -> None:
    """Delete the checkpoint at ``key``: ``experiment.json`` first, then every other file.

    The files are found by listing the folder (so a file a later format adds
    goes too), and the spec's four names are deleted whether listed or not.
    """
    storage.delete(file_key(key, EXPERIMENT_FILE))
    names = set(storage.list_children(key)) | set(FILES)
    names.discard(EXPERIMENT_FILE)
    for name in sorted(names):
        storage.delete(file_key(key, name))


def prune(
    storage: Storage,
    keep_last: int,
    *,
    protect: Iterable[str] = (),
    hold: Callable[[Sequence[StepFolder]], Iterable[str]] | None = None,
) -> list[str]:
    """Delete the complete checkpoints older than the newest ``keep_last`` complete ones.

    Never deletes the newest complete checkpoint (``keep_last`` is at least 1),
    a folder without ``experiment.json``, a key in ``protect`` (the one just
    written), or one ``hold`` keeps, given the old ones, oldest first (those a
    follower has not evaluated). Returns the keys deleted, oldest first. Raises
    :class:`ValueError` for ``keep_last`` below 1 and
    :class:`sexpgpu.errors.StorageError` when listing or deleting fails.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last is at least 1, got {keep_last}")
    kept = set(protect)
    complete = [folder for folder in list_steps(storage) if folder.complete]
    old = complete[: max(0, len(complete) - keep_last)]
    if hold is not None and old:
        kept.update(hold(old))
    deleted = []
    for folder in old:
        if folder.key in kept:
            continue
        delete_checkpoint(storage, folder.key)
        deleted.append(folder.key)
    return deleted
