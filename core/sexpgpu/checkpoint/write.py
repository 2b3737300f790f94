"""Writing a step's checkpoint: the two tensor files and ``state.json`` together,
then ``experiment.json`` last, so a write cut off is never taken for a checkpoint.

Each file's size and CRC32C go into ``experiment.json`` (``files``) and to the
storage backend with the file, so an object store verifies the bytes it receives
and a reader verifies the bytes it reads. Once the checkpoint is stored, what
earlier writes that were cut off left under the location is removed
(:mod:`sexpgpu.checkpoint.tidy`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from sexpgpu.checkpoint.format import encode_safetensors
from sexpgpu.checkpoint.integrity import file_record
from sexpgpu.checkpoint.keys import (
    EXPERIMENT_FILE,
    PARAMS_FILE,
    STATE_FILE,
    STATES_FILE,
    file_key,
    step_key,
)
from sexpgpu.checkpoint.tidy import remove_leftovers

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

    The two tensor files and ``state.json`` are written concurrently, their
    checksums computed meanwhile; only once ``write_many`` has returned is
    ``experiment.json`` written, with ``files`` (each file's size and CRC32C) and
    ``written`` (unix seconds) added, so a checkpoint cut off half way is never
    taken for a complete one. A complete checkpoint already at that step loses
    its ``experiment.json`` first, so it is never complete with a mix of old and
    new files.
    """
    key = step_key(step)
    storage.delete(file_key(key, EXPERIMENT_FILE))
    files = {
        PARAMS_FILE: memoryview(encode_safetensors(params)),
        STATES_FILE: memoryview(encode_safetensors(states)),
        STATE_FILE: memoryview(_json_bytes(state)),
    }
    records = _store(storage, key, files)
    stored = {**experiment, "files": records, "written": round(time.time(), 3)}
    storage.write(file_key(key, EXPERIMENT_FILE), _json_bytes(stored))
    remove_leftovers(storage, step)
    return key


def _store(storage: Storage, key: str, files: Mapping[str, memoryview]) -> dict[str, Any]:
    """Write ``files`` into the checkpoint folder ``key`` and return each one's record.

    A backend that ``takes_crc32c`` (the S3 and GCS ones) is handed the checksums so
    the service verifies the upload; they are computed first then (a few
    milliseconds per GB). Another backend's writes run while the
    checksums are computed on the side (the checksum releases the GIL).
    """
    items = {file_key(key, name): view for name, view in files.items()}
    if storage.takes_crc32c:
        records = {name: file_record(view) for name, view in files.items()}
        checksums = {file_key(key, name): r["crc32c"] for name, r in records.items()}
        storage.write_many(items, crc32c=checksums)  # type: ignore[call-arg]
        return records
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sexpgpu-crc32c") as pool:
        pending = {name: pool.submit(file_record, view) for name, view in files.items()}
        storage.write_many(items)
        return {name: future.result() for name, future in pending.items()}


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
