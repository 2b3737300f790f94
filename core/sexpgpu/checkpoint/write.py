"""Writing a step's checkpoint: the two tensor files and ``state.json`` together,
then ``experiment.json`` last, so a write cut off is never taken for a checkpoint."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sexpgpu.checkpoint.format import encode_safetensors
from sexpgpu.checkpoint.keys import (
    EXPERIMENT_FILE,
    PARAMS_FILE,
    STATE_FILE,
    STATES_FILE,
    file_key,
    step_key,
)

if TYPE_CHECKING:
    import numpy as np

    from sexpgpu.extension import Storage


def write_checkpoint(
    storage: Storage,
    step: int,
    params: Mapping[str, np.ndarray],
    states: Mapping[str, np.ndarray],
    state: dict[str, Any],
    experiment: dict[str, Any],
) -> str:
    """Write the checkpoint of ``step`` under ``storage`` and return its key (``step-00000004``).

    The two tensor files and ``state.json`` are written concurrently; only once
    ``write_many`` has returned is ``experiment.json`` written, so a checkpoint
    cut off half way is never taken for a complete one. A complete checkpoint
    already at that step loses its ``experiment.json`` first, so it is never
    complete with a mix of old and new files.
    """
    key = step_key(step)
    storage.delete(file_key(key, EXPERIMENT_FILE))
    storage.write_many(
        {
            file_key(key, PARAMS_FILE): memoryview(encode_safetensors(params)),
            file_key(key, STATES_FILE): memoryview(encode_safetensors(states)),
            file_key(key, STATE_FILE): _json_bytes(state),
        }
    )
    storage.write(file_key(key, EXPERIMENT_FILE), _json_bytes(experiment))
    return key


def _json_bytes(record: Mapping[str, Any]) -> bytes:
    """A record as JSON people can read and diff: one line per top-level key, and one
    per entry of a list of objects (sources, knobs, params), so it stays small."""
    lines = []
    for key, value in record.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            entries = ",\n".join(
                "  " + json.dumps(v, separators=(", ", ": "), allow_nan=False) for v in value
            )
            text = f"[\n{entries}\n ]"
        else:
            text = json.dumps(value, separators=(", ", ": "), allow_nan=False)
        lines.append(f" {json.dumps(key)}: {text}")
    return ("{\n" + ",\n".join(lines) + "\n}\n").encode()
