"""What everything in a checkpoint is found by: the format number, the folder and
file names, a checkpoint's location as users write it, and the error codes (with
the two small checks every reader of the package shares)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from sexpgpu.errors import CheckpointError

if TYPE_CHECKING:
    from sexpgpu.extension import Storage

FORMAT = 1
"""The checkpoint format this sexpgpu writes, and the newest it reads."""

PARAMS_FILE = "params.safetensors"
STATES_FILE = "states.safetensors"
STATE_FILE = "state.json"
EXPERIMENT_FILE = "experiment.json"
FILES = (PARAMS_FILE, STATES_FILE, STATE_FILE, EXPERIMENT_FILE)
"""The four files of a checkpoint, in the order they are written (experiment.json last)."""

E_MISSING = "E-CKPT-001"
"""No complete checkpoint where one was named."""
E_DAMAGED = "E-CKPT-002"
"""A checkpoint file that is truncated, unreadable or inconsistent."""
E_FOREIGN = "E-CKPT-003"
"""Not a sexpgpu checkpoint, or one from a newer format."""
E_CHANGED = "E-CKPT-004"
"""This program's parameters or optimizer states are not the checkpoint's."""
E_RESUME_LATEST = "E-CKPT-005"
"""``--resume latest`` without a checkpoint location."""
E_CHECKSUM = "E-CKPT-006"
"""A checkpoint file whose size or CRC32C is not the one ``experiment.json`` records."""
E_TOO_DEEP = "E-CKPT-007"
"""A checkpoint's JSON (a record or a safetensors header) nested beyond any sexpgpu writes."""

_STEP_KEY = re.compile(r"^step-(\d{8,})$")


def step_key(step: int) -> str:
    """The folder name of a step's checkpoint: ``step_key(4) == "step-00000004"``."""
    if step < 0:
        raise ValueError(f"a step is never negative: {step}")
    return f"step-{step:08d}"


def parse_step_key(name: str) -> int | None:
    """The step a ``step-<8 digits>`` folder name stands for, or ``None`` for any other name."""
    match = _STEP_KEY.match(name.rstrip("/"))
    return int(match.group(1)) if match else None


def file_key(key: str, name: str) -> str:
    """The key of the file ``name`` in the checkpoint at ``key`` (``""``: the location itself)."""
    return f"{key}/{name}" if key else name


def location_of(storage: Storage, key: str) -> str:
    """The checkpoint's location as users write it (``/tmp/run/step-00000004``)."""
    if not key:
        return storage.uri
    return (storage.uri if storage.uri.endswith("/") else storage.uri + "/") + key


def damaged(where: str, what: str) -> CheckpointError:
    """The error for a checkpoint file at ``where`` that is not what it should be."""
    return CheckpointError(f"{where} is damaged: {what}", code=E_DAMAGED)


def is_count(value: Any) -> bool:
    """Whether a JSON value is a whole number of at least 0 (``true`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
