"""The checkpoint layer: writing, finding, reading, checking and describing checkpoints,
and reading the ``:load`` files a checkpoint pins.

A checkpoint is one folder ``step-<8 digits>`` under a checkpoint location
holding four files (see docs/checkpoints.md):

``params.safetensors``
    one tensor per parameter (``bf16`` stored as ``f32``), keyed by dotted path;
    a frozen parameter read with ``:load`` is named in ``experiment.json``
    instead of copied.
``states.safetensors``
    one tensor per optimizer state, keyed ``<param path>/<state>``.
``state.json``
    where the run is: step, stage, records, counters, loader position, seed.
``experiment.json``
    what the run is, written last: a checkpoint counts only once it exists.

Everything here is torch-free (numpy and JSON) and never unpickles anything.
One concern per module: :mod:`~sexpgpu.checkpoint.keys` (names, locations, error
codes), :mod:`~sexpgpu.checkpoint.records` (the two JSON records),
:mod:`~sexpgpu.checkpoint.format` (the safetensors format and its checks),
:mod:`~sexpgpu.checkpoint.write`, :mod:`~sexpgpu.checkpoint.find`,
:mod:`~sexpgpu.checkpoint.read`, :mod:`~sexpgpu.checkpoint.resume` (the resume
policy) and :mod:`~sexpgpu.checkpoint.describe` (what ``sexpgpu checkpoint``
shows, as data), :mod:`~sexpgpu.checkpoint.integrity` (CRC32C checksums),
:mod:`~sexpgpu.checkpoint.schema` (the records' JSON Schemas, bounded JSON) and
:mod:`~sexpgpu.checkpoint.tidy` (removing what cut-off writes left),
:mod:`~sexpgpu.checkpoint.storage` (what the storage backends behind checkpoint
locations share), :mod:`~sexpgpu.checkpoint.checkpointer` (a run's writes, off its step loop, and
retention), :mod:`~sexpgpu.checkpoint.evaluated` (what a follower has evaluated,
and what retention keeps for it), :mod:`~sexpgpu.checkpoint.verify` (``--verify``),
:mod:`~sexpgpu.checkpoint.loads` (the ``:load`` files of a program: checked,
identified, read) and :mod:`~sexpgpu.checkpoint.hashing` (a local one read once
while a thread hashes it). The names below are the layer's public API.
"""

from __future__ import annotations

from sexpgpu.checkpoint.describe import (
    CheckpointDescription,
    KnobRecord,
    LoadRecord,
    SourceRecord,
    TensorFile,
    TensorHeader,
    describe_checkpoint,
)
from sexpgpu.checkpoint.find import (
    complete_before,
    find_latest,
    open_checkpoint,
    resolve_resume,
)
from sexpgpu.checkpoint.format import (
    decode_safetensors,
    encode_safetensors,
    layout_tensors,
    parse_header,
)
from sexpgpu.checkpoint.integrity import crc32c
from sexpgpu.checkpoint.keys import (
    E_CHANGED,
    E_CHECKSUM,
    E_DAMAGED,
    E_FOREIGN,
    E_MISSING,
    E_RESUME_LATEST,
    E_TOO_DEEP,
    EXPERIMENT_FILE,
    FILES,
    FORMAT,
    PARAMS_FILE,
    STATE_FILE,
    STATES_FILE,
    location_of,
    parse_step_key,
    step_key,
)
from sexpgpu.checkpoint.listing import CheckpointEntry, list_checkpoints
from sexpgpu.checkpoint.read import (
    Loaded,
    load_checkpoint,
    read_experiment,
    read_header,
    read_state,
)
from sexpgpu.checkpoint.records import (
    expected_tensors,
    experiment_record,
    jsonable,
    shape_text,
    state_record,
    value_text,
)
from sexpgpu.checkpoint.resume import (
    E_DEVICES,
    check_position,
    compare_for_resume,
    compare_loads,
    load_for_resume,
)
from sexpgpu.checkpoint.schema import EXPERIMENT_SCHEMA, SLUG_PATTERN, STATE_SCHEMA
from sexpgpu.checkpoint.tidy import remove_leftovers
from sexpgpu.checkpoint.write import write_checkpoint

__all__ = [
    "E_CHANGED",
    "E_CHECKSUM",
    "E_DAMAGED",
    "E_TOO_DEEP",
    "EXPERIMENT_SCHEMA",
    "SLUG_PATTERN",
    "STATE_SCHEMA",
    "CheckpointEntry",
    "check_position",
    "complete_before",
    "crc32c",
    "list_checkpoints",
    "load_for_resume",
    "remove_leftovers",
    "E_DEVICES",
    "E_FOREIGN",
    "E_MISSING",
    "E_RESUME_LATEST",
    "EXPERIMENT_FILE",
    "FILES",
    "FORMAT",
    "PARAMS_FILE",
    "STATES_FILE",
    "STATE_FILE",
    "CheckpointDescription",
    "KnobRecord",
    "LoadRecord",
    "Loaded",
    "SourceRecord",
    "TensorFile",
    "TensorHeader",
    "compare_for_resume",
    "compare_loads",
    "decode_safetensors",
    "describe_checkpoint",
    "encode_safetensors",
    "expected_tensors",
    "experiment_record",
    "find_latest",
    "layout_tensors",
    "load_checkpoint",
    "location_of",
    "open_checkpoint",
    "parse_header",
    "parse_step_key",
    "read_experiment",
    "read_header",
    "read_state",
    "resolve_resume",
    "shape_text",
    "state_record",
    "step_key",
    "value_text",
    "write_checkpoint",
    "jsonable",
]
