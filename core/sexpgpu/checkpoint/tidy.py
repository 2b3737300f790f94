"""Removing what writes that were cut off left under a checkpoint location.

A write cut off (the machine gone, kill -9) leaves a ``step-<n>`` folder without
``experiment.json``, and on a local folder ``.sexpgpu-tmp-*`` files, each as large
as a tensor file. Nothing reads them, so once a later checkpoint of the same
location is stored they are removed: the folders of earlier steps that are not
complete, and the temporary files of the stored step and every earlier one.
Never a complete checkpoint, never the one just stored, never a step after it
(the resume that will rewrite it has not got there yet).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from sexpgpu.checkpoint.find import steps_of
from sexpgpu.checkpoint.keys import EXPERIMENT_FILE, file_key
from sexpgpu.errors import StorageError

if TYPE_CHECKING:
    from sexpgpu.extension import Storage

# The complete steps seen per opened location, so each folder is asked about once
# (a HEAD per folder on a bucket) and not at every checkpoint.
_KNOWN_COMPLETE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remove_leftovers(storage: Storage, stored: int) -> list[str]:
    """Remove the leftovers of cut-off writes at steps up to ``stored`` (the step whose
    checkpoint was just stored) and return the keys of the folders removed.

    A failure to remove is not the checkpoint's failure: the files stay for the
    next checkpoint to remove, and nothing else is affected.
    """
    try:
        known = _KNOWN_COMPLETE.setdefault(storage, set())
    except TypeError:  # a backend object that cannot be weakly referenced
        known = set()
    removed = []
    try:
        for step, folder in steps_of(storage):
            if step > stored or step in known:
                continue
            storage.remove_temporaries(folder)
            if step == stored or storage.exists(file_key(folder, EXPERIMENT_FILE)):
                known.add(step)
                continue
            for child in storage.list_children(folder):
                storage.delete(file_key(folder, child))
            removed.append(folder)
    except StorageError:
        pass
    return removed
