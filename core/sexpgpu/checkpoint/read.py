"""Reading a checkpoint back: its records, its tensor headers (by ranged reads) and
its tensors, each checked against ``experiment.json`` before it is trusted, so a
damaged or foreign checkpoint is refused with one clear error."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sexpgpu.checkpoint.find import require_complete
from sexpgpu.checkpoint.format import decode_safetensors, header_length, parse_header
from sexpgpu.checkpoint.integrity import verify
from sexpgpu.checkpoint.keys import (
    E_DAMAGED,
    E_FOREIGN,
    EXPERIMENT_FILE,
    PARAMS_FILE,
    STATE_FILE,
    STATES_FILE,
    damaged,
    file_key,
    location_of,
    parse_step_key,
)
from sexpgpu.checkpoint.records import (
    check_experiment,
    check_state,
    expected_tensors,
    is_dotted_path,
)
from sexpgpu.checkpoint.schema import load_json
from sexpgpu.checkpoint.storage import NO_SUCH_LOCATION
from sexpgpu.errors import CheckpointError, StorageError

if TYPE_CHECKING:
    import numpy as np

    from sexpgpu.extension import Storage


@dataclass(frozen=True)
class Loaded:
    """A checkpoint read back and checked: its two records and its tensors as numpy."""

    location: str
    experiment: dict[str, Any]
    state: dict[str, Any]
    params: dict[str, np.ndarray]
    states: dict[str, np.ndarray]

    @property
    def step(self) -> int:
        """The step the checkpoint was taken after."""
        return int(self.state["step"])


def _read_json(storage: Storage, key: str, name: str) -> tuple[Any, bytes]:
    """A checkpoint's JSON file decoded (nesting bounded) and its bytes, to be verified
    against its checksum once its content has been checked (which says more)."""
    where = location_of(storage, file_key(key, name))
    data = _read_part(storage, file_key(key, name))
    return load_json(data, where, damaged), data


def read_experiment(storage: Storage, key: str) -> dict[str, Any]:
    """``experiment.json`` of the checkpoint at ``key``, checked to be one this sexpgpu reads."""
    require_complete(storage, key)
    return read_experiment_bytes(storage, key)[0]


def read_experiment_bytes(storage: Storage, key: str) -> tuple[dict[str, Any], bytes]:
    """``experiment.json`` at ``key`` checked, and its bytes, read in one request; for a
    caller that knows the checkpoint is complete (it has just listed or seen the file)."""
    where = location_of(storage, file_key(key, EXPERIMENT_FILE))
    record, data = _read_json(storage, key, EXPERIMENT_FILE)
    return check_experiment(record, where), data


def read_state(
    storage: Storage, key: str, experiment: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``state.json`` of the checkpoint at ``key``, checked: its schema, its step against
    the folder's ``step-<n>``, and its checksum when ``experiment`` (the checkpoint's
    ``experiment.json``) records one."""
    where = location_of(storage, file_key(key, STATE_FILE))
    files = experiment.get("files") if experiment is not None else None
    folder = parse_step_key(key.rsplit("/", 1)[-1]) if key else None
    record, data = _read_json(storage, key, STATE_FILE)
    state = check_state(record, where, step=folder)
    verify(data, (files or {}).get(STATE_FILE), where)
    return state


def _read_part(storage: Storage, path: str, start: int = 0, length: int | None = None) -> bytes:
    """A checkpoint file's bytes (all, or ``length`` from ``start``) in one request: a
    file that is not there is found by asking for it, not by looking for it first."""
    try:
        if length is None:
            return storage.read(path)
        return storage.read_range(path, start, length)
    except StorageError as exc:
        if exc.code != NO_SUCH_LOCATION:
            raise
        raise missing(storage, path) from None


def missing(storage: Storage, path: str) -> CheckpointError:
    """The error for the checkpoint file at ``path`` that is not there (``E-CKPT-002``)."""
    where = location_of(storage, path)
    return CheckpointError(f"{where} is missing from the checkpoint", code=E_DAMAGED)


def read_header(storage: Storage, key: str) -> dict[str, Any]:
    """A tensor file's header, checked, read by ranged reads and never its tensor data.

    The file's length is checked by reading the last byte its tensors need and
    the one after it, so a truncated file is found without reading it.
    """
    where = location_of(storage, key)
    length = header_length(_read_part(storage, key, 0, 8), where, None)
    raw = storage.read_range(key, 8, length)
    if len(raw) < length:
        raise damaged(where, f"its header length {length} goes beyond the file")
    header, need = parse_header(raw, where)
    start = 8 + length
    if need:
        tail = len(storage.read_range(key, start + need - 1, 2))
        if tail == 0:
            raise damaged(
                where, f"it ends before the {need} bytes of data its header describes (truncated)"
            )
        if tail > 1:
            raise damaged(where, "it has bytes after its tensors")
    elif storage.read_range(key, start, 1):
        raise damaged(where, "it has bytes after its tensors")
    return header


def foreign_tensor(header: Mapping[str, Any], what: str) -> str | None:
    """What is wrong with the first tensor name in ``header`` that sexpgpu never writes
    as a ``what`` (``"parameter"``: a dotted path; ``"state"``: ``<path>/<state>``),
    worded for after the file's name; ``None`` when every name is one. A resume
    refuses it (``E-CKPT-003``) and ``sexpgpu checkpoint`` says it the same way."""
    for name in header:
        parts = name.split("/")
        if not all(is_dotted_path(part) for part in parts) or len(parts) > (
            2 if what == "state" else 1
        ):
            return f"has a tensor named {name!r}, which is no {what} name"
    return None


def _check_names(header: Mapping[str, Any], expected: set[str], where: str, what: str) -> None:
    foreign = foreign_tensor(header, what)
    if foreign is not None:
        raise CheckpointError(f"{where} {foreign}", code=E_FOREIGN)
    extra = sorted(set(header) - expected)
    missing = sorted(expected - set(header))
    if extra or missing:
        said = []
        if missing:
            said.append("it lacks " + ", ".join(missing))
        if extra:
            said.append("it has " + ", ".join(extra) + " that experiment.json does not list")
        raise CheckpointError(
            f"{where} does not hold experiment.json's tensors: " + "; ".join(said),
            code=E_DAMAGED,
        )


def _read_tensor_file(
    storage: Storage, key: str, name: str, files: Mapping[str, Any] | None
) -> tuple[dict[str, np.ndarray], str, bytes]:
    """A checkpoint's tensor file decoded, where it is (for messages) and its bytes, to
    be verified once its structure has been checked (which says more than a checksum)."""
    path = file_key(key, name)
    where = location_of(storage, path)
    data = _read_part(storage, path)
    return decode_safetensors(data, where), where, data


def _check_tensors(
    arrays: Mapping[str, np.ndarray],
    shapes: Mapping[str, list],
    where: str,
    what: str,
    declared: str,
) -> None:
    """Every tensor is F32 (how a checkpoint stores parameters and states, ``bf16``
    included) with its declared shape; a state may also be a scalar."""
    for name, array in arrays.items():
        if array.dtype.name != "float32":
            raise damaged(where, f"{name} is {array.dtype}, where a {what} is stored as F32")
        shape = list(array.shape)
        if shape != shapes[name] and not (what == "state" and shape == []):
            raise damaged(where, f"{name} has the shape {shape}, where {declared} {shapes[name]}")


def load_checkpoint(storage: Storage, key: str, *, with_states: bool = True) -> Loaded:
    """Read the checkpoint at ``key`` and check everything before handing it over.

    Refuses (with :class:`sexpgpu.errors.CheckpointError`, never a fresh start)
    a checkpoint that is incomplete, has a file missing, truncated or not
    parseable, is from a newer format, or whose tensors' names, shapes or
    dtypes are not the ones ``experiment.json`` declares. ``with_states=False``
    skips ``states.safetensors`` (evaluation never needs it).
    """
    experiment = read_experiment(storage, key)
    state = read_state(storage, key, experiment)
    files = experiment.get("files")
    want_params, want_states = expected_tensors(experiment)
    shapes = {entry["path"]: entry["shape"] for entry in experiment["params"]}

    params, where, data = _read_tensor_file(storage, key, PARAMS_FILE, files)
    _check_names(params, set(want_params), where, "parameter")
    _check_tensors(params, want_params, where, "parameter", "experiment.json says")
    verify(data, (files or {}).get(PARAMS_FILE), where)
    del data

    states: dict[str, np.ndarray] = {}
    if with_states:
        states, where, data = _read_tensor_file(storage, key, STATES_FILE, files)
        _check_names(states, set(want_states), where, "state")
        # A state is per parameter: its shape is the parameter's, or a scalar.
        allowed = {name: shapes[path] for name, path in want_states.items()}
        _check_tensors(states, allowed, where, "state", "its parameter is")
        verify(data, (files or {}).get(STATES_FILE), where)
    return Loaded(location_of(storage, key), experiment, state, params, states)
