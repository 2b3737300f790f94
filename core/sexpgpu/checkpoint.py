"""The checkpoint layer: writing, finding, reading, checking and describing checkpoints.

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
Tensor files are written in the safetensors format by :func:`encode_safetensors`
with a single copy of the data, and every file read back is checked before it
is trusted, so a damaged or foreign checkpoint is refused with one clear
error instead of being taken for a fresh start.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sexpgpu.errors import CheckpointError, StorageError, UsageError
from sexpgpu.storage import NO_SUCH_LOCATION

if TYPE_CHECKING:
    import numpy as np

    from sexpgpu.extension import Storage
    from sexpgpu.graph import Program

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

_STEP_KEY = re.compile(r"^step-(\d{8,})$")
# One component of a dotted parameter path: no separators, no whitespace, no
# control characters; splitting on "." already rules out "" and "..".
_PATH_PART = re.compile(r"^[^\s/\\.\x00-\x1f\x7f]+$")
_STATE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# safetensors refuses headers above 100 MB; a larger length is damage, not a header.
_MAX_HEADER = 100_000_000

# safetensors dtype name -> numpy dtype string, for the dtypes a checkpoint may hold.
_ST_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "|i1",
    "U8": "|u1",
    "BOOL": "|b1",
}
_NP_TO_ST = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64"}
_NP_TO_ST.update({"int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"})


# ------------------------------------------------------------------ keys


def step_key(step: int) -> str:
    """The folder name of a step's checkpoint: ``step_key(4) == "step-00000004"``."""
    if step < 0:
        raise ValueError(f"a step is never negative: {step}")
    return f"step-{step:08d}"


def parse_step_key(name: str) -> int | None:
    """The step a ``step-<8 digits>`` folder name stands for, or ``None`` for any other name."""
    match = _STEP_KEY.match(name.rstrip("/"))
    return int(match.group(1)) if match else None


def _join(key: str, name: str) -> str:
    return f"{key}/{name}" if key else name


def location_of(storage: Storage, key: str) -> str:
    """The checkpoint's location as users write it (``/tmp/run/step-00000004``)."""
    if not key:
        return storage.uri
    return (storage.uri if storage.uri.endswith("/") else storage.uri + "/") + key


# ------------------------------------------------------------------ records


def _jsonable(value: Any) -> Any:
    """A knob's value as JSON: tuples become lists, anything exotic its text."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def _stored(param: Any) -> bool:
    """Whether a parameter's tensor is in params.safetensors: all but a frozen ``:load`` one."""
    return param.load is None or param.trainable


def experiment_record(
    program: Program,
    *,
    choices: Mapping[str, str],
    slug: str,
    devices: int,
    nodes: int,
    finished: bool,
    state_names: Mapping[str, tuple[str, ...]] | None = None,
    loaded: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The content of ``experiment.json``: what the run is, as docs/checkpoints.md lists.

    ``state_names`` maps each parameter path to the optimizer states the current
    stage keeps for it (``OptimizerInfo.state_names(options)``; frozen ones have
    none). ``loaded`` maps a ``:load`` parameter's path to the identity of the
    file it was read from (``{"size": int, "version": str}``, and ``uri``/``tensor``
    when they differ from the declaration, e.g. the shard of an index).
    """
    from sexpgpu import __version__

    state_names = state_names or {}
    loaded = loaded or {}
    params = []
    for param in program.params:
        entry: dict[str, Any] = {
            "path": param.path,
            "shape": list(param.type.shape),
            "dtype": param.type.dtype,
            "trainable": bool(param.trainable),
            "tags": list(param.tags),
        }
        if param.load is not None:
            pinned = dict(loaded.get(param.path, {}))
            entry["load"] = {
                "uri": pinned.get("uri", param.load.uri),
                "tensor": pinned.get("tensor", param.load.tensor),
                "size": pinned.get("size"),
                "version": pinned.get("version"),
            }
        params.append(entry)
    return {
        "format": FORMAT,
        "sexpgpu": __version__,
        "run": program.run.name,
        "file": program.file,
        "slug": slug,
        "finished": bool(finished),
        "sources": [{"name": s.name, "sha256": s.sha256} for s in program.sources],
        "variant": program.variant or "-",
        "knobs": [
            {"name": k.name, "value": _jsonable(k.value), "source": k.source} for k in program.knobs
        ],
        "params": params,
        "states": {
            p.path: list(state_names[p.path]) for p in program.params if state_names.get(p.path)
        },
        "counters": list(program.run.counters),
        "precision": program.run.precision,
        "seed": program.run.seed,
        "devices": int(devices),
        "nodes": int(nodes),
        "choices": {site: choices[site] for site in sorted(choices)},
    }


def state_record(
    *,
    step: int,
    stage: int,
    records: int,
    counters: Mapping[str, int],
    loader: Mapping[str, Any] | None,
    seed: int,
    evals_pending: Sequence[str] = (),
) -> dict[str, Any]:
    """The content of ``state.json``: where the run is when the checkpoint is taken.

    ``evals_pending`` names the evaluation passes due at this step that a signal
    stopped before they reported; the resume runs them first.
    """
    return {
        "step": int(step),
        "stage": int(stage),
        "records": int(records),
        "counters": {name: int(value) for name, value in counters.items()},
        "loader": _jsonable(dict(loader)) if loader is not None else None,
        "seed": int(seed),
        "evals_pending": [str(name) for name in evals_pending],
    }


# ------------------------------------------------------------------ safetensors


def _layout(specs: Mapping[str, tuple[tuple[int, ...], Any]]) -> tuple[bytes, dict[str, int]]:
    """A safetensors file's first bytes (length and header) and each tensor's offset in
    the file, for tensors given as name -> (shape, numpy dtype).

    Tensors are ordered as ``safetensors`` orders them (element size, largest first,
    then name) and the header is padded with spaces to 8 bytes, so the file is
    byte for byte the one ``safetensors.numpy.save`` makes.
    """
    order = sorted(specs, key=lambda name: (-specs[name][1].itemsize, name))
    header: dict[str, Any] = {}
    offset = 0
    for name in order:
        shape, dtype = specs[name]
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _NP_TO_ST[dtype.name],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    return prefix, {name: len(prefix) + header[name]["data_offsets"][0] for name in order}


def _specs(tensors: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], Any]]:
    import numpy as np

    specs = {}
    for name, (shape, dtype) in tensors.items():
        dtype = np.dtype(dtype)
        if dtype.name not in _NP_TO_ST:
            raise CheckpointError(f"{name}: cannot store a {dtype} tensor in a checkpoint")
        specs[name] = (tuple(int(n) for n in shape), dtype.newbyteorder("<"))
    return specs


def layout_tensors(specs: Mapping[str, tuple[tuple[int, ...], Any]]) -> dict[str, np.ndarray]:
    """Zeroed, writable arrays (name -> (shape, dtype)) that already lie in one buffer
    as a safetensors file: :func:`encode_safetensors` (and so :func:`write_checkpoint`)
    then stores that buffer as it is, without copying a byte.

    A trainer's ``export`` can copy its tensors from the device into these arrays
    instead of into arrays of its own, saving a copy of the model per checkpoint.
    """
    import numpy as np

    specs = _specs(specs)
    prefix, offsets = _layout(specs)
    size = len(prefix) + sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs.values())
    # np.zeros maps fresh zero pages lazily; bytearray(size) would write every byte.
    view = np.zeros(size, dtype=np.uint8)
    view[: len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
    out = {}
    for name, (shape, dtype) in specs.items():
        begin = offsets[name]
        nbytes = math.prod(shape) * dtype.itemsize
        out[name] = view[begin : begin + nbytes].view(dtype).reshape(shape)
    return out


def _laid_out(arrays: Mapping[str, np.ndarray], prefix: bytes, offsets: Mapping[str, int]):
    """The buffer ``arrays`` already lie in as this very file (see :func:`layout_tensors`),
    or ``None`` when they do not."""
    import numpy as np

    root: Any = next((a for a in arrays.values() if a.nbytes), None)
    if root is None:
        return None
    while isinstance(root.base, np.ndarray):  # numpy points a view at the array owning it
        root = root.base
    if root.base is not None or root.dtype != np.uint8 or root.ndim != 1:
        return None
    size = len(prefix) + sum(a.nbytes for a in arrays.values())
    if len(root) != size or bytes(root[: len(prefix)]) != prefix:
        return None
    address = root.ctypes.data
    for name, array in arrays.items():
        if array.nbytes and (
            array.ctypes.data != address + offsets[name] or not array.flags.c_contiguous
        ):
            return None
    return root


def encode_safetensors(tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    """``tensors`` in the safetensors format, with at most one copy of the data.

    The bytes are those ``safetensors.numpy.save`` makes for the same arrays, so
    any safetensors reader loads them; ``save`` copies every tensor twice, which
    a checkpoint of a large model feels. Arrays made by :func:`layout_tensors`
    are not copied at all: their buffer is returned as it is. Returns the file's
    bytes as a 1-D ``uint8`` array (a buffer: ``memoryview`` or ``bytes`` of it).
    """
    import numpy as np

    arrays = {}
    for name, value in tensors.items():
        array = np.asarray(value)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        arrays[name] = array
    specs = _specs({name: (a.shape, a.dtype) for name, a in arrays.items()})
    prefix, offsets = _layout(specs)
    ready = _laid_out(arrays, prefix, offsets)
    if ready is not None:
        return ready
    # np.empty leaves the pages untouched until the copy writes them; bytearray(n)
    # would first write zeros over all of them, doubling the memory traffic.
    out = np.empty(len(prefix) + sum(a.nbytes for a in arrays.values()), dtype=np.uint8)
    out[: len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
    view = out
    for name, array in arrays.items():
        if array.nbytes:
            # copyto through a view of the destination: one memcpy per tensor.
            begin = offsets[name]
            target = view[begin : begin + array.nbytes].view(specs[name][1]).reshape(array.shape)
            np.copyto(target, array, casting="no")
    return out


def _damaged(where: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where} is damaged: {what}", code=E_DAMAGED)


def _header_length(head: bytes, where: str, size: int | None) -> int:
    """The header length in a file's first 8 bytes, checked against the file's size."""
    if len(head) < 8:
        raise _damaged(where, f"{len(head)} bytes is too short for a safetensors file")
    (length,) = struct.unpack("<Q", bytes(head[:8]))
    limit = _MAX_HEADER if size is None else min(size - 8, _MAX_HEADER)
    if length > limit:
        raise _damaged(where, f"its header length {length} goes beyond the file")
    return length


def parse_header(raw: bytes, where: str) -> tuple[dict[str, Any], int]:
    """Check and decode a safetensors header (the JSON after the 8-byte length).

    Returns (the header without ``__metadata__``, the bytes of tensor data it
    describes). Every tensor must have a known dtype, a shape, and offsets that
    hold exactly its bytes, one after the other from 0, as the format requires;
    anything else raises :class:`CheckpointError`.
    """
    try:
        header = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _damaged(where, "its header is not JSON (truncated?)") from None
    if not isinstance(header, dict):
        raise _damaged(where, "its header is not a JSON object")
    header.pop("__metadata__", None)
    spans = []
    for name, entry in header.items():
        if not (
            isinstance(entry, dict)
            and entry.get("dtype") in _ST_DTYPES
            and isinstance(entry.get("shape"), list)
            and all(_is_count(n) for n in entry["shape"])
            and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2
            and all(_is_count(n) for n in entry["data_offsets"])
        ):
            raise _damaged(where, f"the header entry of {name!r} is not a readable tensor")
        begin, end = entry["data_offsets"]
        itemsize = int(_ST_DTYPES[entry["dtype"]][2:])
        if end - begin != math.prod(entry["shape"]) * itemsize:
            raise _damaged(where, f"{name!r} does not have the bytes its shape needs")
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise _damaged(where, f"the data of {name!r} does not follow the tensor before it")
        position = end
    return header, position


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _size_mismatch(where: str, need: int, have: int) -> CheckpointError:
    if have < need:
        return _damaged(
            where, f"its tensors need {need} bytes of data and it holds {have} (truncated)"
        )
    return _damaged(where, f"it has {have - need} bytes after its tensors")


def decode_safetensors(data: bytes, where: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, checked by :func:`parse_header` first, as
    writable numpy arrays. Never unpickles: the format is a JSON header and raw bytes."""

    length = _header_length(data[:8], where, len(data))
    header, need = parse_header(data[8 : 8 + length], where)
    start = 8 + length
    if len(data) - start != need:
        raise _size_mismatch(where, need, len(data) - start)
    from safetensors.numpy import load

    try:
        return load(bytes(data))
    except Exception as exc:  # the checks above should have caught it; say so plainly
        raise _damaged(where, f"safetensors cannot read it: {exc}") from None


def _read_part(storage: Storage, file_key: str, start: int = 0, length: int | None = None) -> bytes:
    """A checkpoint file's bytes (all, or ``length`` from ``start``) in one request: a
    file that is not there is found by asking for it, not by looking for it first."""
    try:
        if length is None:
            return storage.read(file_key)
        return storage.read_range(file_key, start, length)
    except StorageError as exc:
        if exc.code != NO_SUCH_LOCATION:
            raise
        where = location_of(storage, file_key)
        raise CheckpointError(f"{where} is missing from the checkpoint", code=E_DAMAGED) from None


def read_header(storage: Storage, key: str) -> dict[str, Any]:
    """A tensor file's header, checked, read by ranged reads and never its tensor data.

    The file's length is checked by reading the last byte its tensors need and
    the one after it, so a truncated file is found without reading it.
    """
    where = location_of(storage, key)
    length = _header_length(_read_part(storage, key, 0, 8), where, None)
    raw = storage.read_range(key, 8, length)
    if len(raw) < length:
        raise _damaged(where, f"its header length {length} goes beyond the file")
    header, need = parse_header(raw, where)
    start = 8 + length
    if need:
        tail = len(storage.read_range(key, start + need - 1, 2))
        if tail == 0:
            raise _damaged(
                where, f"it ends before the {need} bytes of data its header describes (truncated)"
            )
        if tail > 1:
            raise _damaged(where, "it has bytes after its tensors")
    elif storage.read_range(key, start, 1):
        raise _damaged(where, "it has bytes after its tensors")
    return header


# ------------------------------------------------------------------ writing


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
    storage.delete(_join(key, EXPERIMENT_FILE))
    storage.write_many(
        {
            _join(key, PARAMS_FILE): memoryview(encode_safetensors(params)),
            _join(key, STATES_FILE): memoryview(encode_safetensors(states)),
            _join(key, STATE_FILE): _json_bytes(state),
        }
    )
    storage.write(_join(key, EXPERIMENT_FILE), _json_bytes(experiment))
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


# ------------------------------------------------------------------ finding


def find_latest(storage: Storage) -> str | None:
    """The key of the highest complete ``step-<n>`` under ``storage``, or ``None``.

    Names that are not ``step-<8 digits>`` are ignored, and so is a step folder
    without ``experiment.json`` (a write cut off). A location that cannot be
    listed raises :class:`sexpgpu.errors.StorageError`: never a fresh start.
    """
    steps = []
    for name in storage.list_children(""):
        step = parse_step_key(name)
        if step is not None:
            steps.append((step, name.rstrip("/")))
    for _, name in sorted(steps, reverse=True):
        if storage.exists(_join(name, EXPERIMENT_FILE)):
            return name
    return None


def open_checkpoint(location: str) -> tuple[Storage, str]:
    """Open a checkpoint named by its location (``/tmp/run/step-00000004``,
    ``s3://bucket/prefix/step-00000004``) as (storage of its parent, key).

    A location whose last part is not ``step-<n>`` (a copied checkpoint) is
    opened itself, with the key ``""``. Nothing is read yet.
    """
    from sexpgpu.storage import open_location, scheme_of

    text = location.strip()
    trimmed = text.rstrip("/") or text
    parent, _, name = trimmed.rpartition("/")
    if parse_step_key(name) is None:
        return open_location(trimmed), ""
    if not parent or parent.endswith(":/"):
        # "step-00000004" alone is in the working directory; "s3://step-..." has no bucket.
        if scheme_of(trimmed) != "file":
            return open_location(trimmed), ""
        parent = parent or ("/" if trimmed.startswith("/") else ".")
    return open_location(parent), name


def resolve_resume(value: str, checkpoint_dir: str | None) -> tuple[Storage, str] | None:
    """What ``--resume value`` resumes from: (storage, key), or ``None`` for a fresh start.

    ``latest`` takes the highest complete step under ``checkpoint_dir`` (an error
    without one; ``None`` when there is none yet). Any other value is a
    checkpoint's location, which must hold a complete checkpoint.
    """
    from sexpgpu.storage import open_location

    if value.strip() == "latest":
        if not checkpoint_dir:
            raise UsageError(
                "--resume latest needs a checkpoint location "
                "(--checkpoint-dir or SEXPGPU_CHECKPOINT_DIR)",
                code=E_RESUME_LATEST,
            )
        storage = open_location(checkpoint_dir)
        key = find_latest(storage)
        return None if key is None else (storage, key)
    storage, key = open_checkpoint(value)
    _require_complete(storage, key)
    return storage, key


def _require_complete(storage: Storage, key: str) -> None:
    if storage.exists(_join(key, EXPERIMENT_FILE)):
        return
    where = location_of(storage, key)
    if any(storage.exists(_join(key, name)) for name in FILES[:-1]):
        raise CheckpointError(
            f"{where} is not a complete checkpoint: it has no {EXPERIMENT_FILE} "
            "(its writing was cut off)",
            code=E_MISSING,
        )
    raise CheckpointError(f"there is no checkpoint at {where}", code=E_MISSING)


# ------------------------------------------------------------------ reading


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


def _read_json(storage: Storage, key: str, name: str) -> Any:
    where = location_of(storage, _join(key, name))
    data = _read_part(storage, _join(key, name))
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _damaged(where, "it is not valid JSON (truncated?)") from None


def _check_path(path: Any, where: str) -> str:
    if not isinstance(path, str) or not all(_PATH_PART.match(p) for p in path.split(".")):
        raise CheckpointError(
            f"{where} names a parameter {path!r} that is not a dotted path", code=E_FOREIGN
        )
    return path


def read_experiment(storage: Storage, key: str) -> dict[str, Any]:
    """``experiment.json`` of the checkpoint at ``key``, checked to be one this sexpgpu reads."""
    _require_complete(storage, key)
    where = location_of(storage, _join(key, EXPERIMENT_FILE))
    record = _read_json(storage, key, EXPERIMENT_FILE)
    if not isinstance(record, dict) or not _is_count(record.get("format")):
        raise CheckpointError(
            f"{where} is not a sexpgpu checkpoint's (it has no format number)", code=E_FOREIGN
        )
    if record["format"] > FORMAT:
        from sexpgpu import __version__

        raise CheckpointError(
            f"{where} is format {record['format']}, from a newer sexpgpu "
            f"({record.get('sexpgpu', '?')}); sexpgpu {__version__} reads format {FORMAT}: "
            "upgrade sexpgpu to read it",
            code=E_FOREIGN,
        )

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where} is not a sexpgpu checkpoint's: {what}", code=E_FOREIGN)

    params = record.get("params")
    if not isinstance(params, list):
        raise bad("it has no params list")
    seen = set()
    for entry in params:
        if not isinstance(entry, dict):
            raise bad("a params entry is not an object")
        path = _check_path(entry.get("path"), where)
        if path in seen:
            raise bad(f"{path} is listed twice")
        seen.add(path)
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
            raise bad(f"{path} has no shape")
        if entry.get("dtype") not in ("f32", "bf16"):
            raise bad(f"{path} has the dtype {entry.get('dtype')!r}")
        if not isinstance(entry.get("trainable"), bool):
            raise bad(f"{path} does not say whether it trains")
        tags = entry.get("tags", [])
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise bad(f"{path} has tags that are not names")
        load = entry.get("load")
        if load is not None and not (isinstance(load, dict) and isinstance(load.get("uri"), str)):
            raise bad(f"{path} has a load that names no file")
    states = record.get("states", {})
    if not isinstance(states, dict):
        raise bad("its states are not an object")
    for path, names in states.items():
        if path not in seen:
            raise bad(f"it has states for {path!r}, which is not one of its parameters")
        if not isinstance(names, list) or not all(
            isinstance(n, str) and _STATE_NAME.match(n) for n in names
        ):
            raise bad(f"the state names of {path} are not names")
    for name, kind in (("sources", list), ("knobs", list), ("choices", dict), ("slug", str)):
        if not isinstance(record.get(name), kind):
            raise bad(f"it has no {name}")
    for name in ("devices", "nodes"):
        if not _is_count(record.get(name, 1)):
            raise bad(f"its {name} is not a count")
    return record


def read_state(storage: Storage, key: str) -> dict[str, Any]:
    """``state.json`` of the checkpoint at ``key``, checked."""
    where = location_of(storage, _join(key, STATE_FILE))
    state = _read_json(storage, key, STATE_FILE)
    if not isinstance(state, dict):
        raise _damaged(where, "it is not a JSON object")
    for name in ("step", "stage", "records", "seed"):
        value = state.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or (name != "seed" and value < 0):
            raise _damaged(where, f"its {name} is not a whole number")
    counters = state.get("counters", {})
    if not isinstance(counters, dict) or not all(_is_count(v) for v in counters.values()):
        raise _damaged(where, "its counters are not counts")
    if state.get("loader") is not None and not isinstance(state["loader"], dict):
        raise _damaged(where, "its loader position is not a JSON object")
    return state


def expected_tensors(experiment: Mapping[str, Any]) -> tuple[dict[str, list], dict[str, str]]:
    """From ``experiment.json``: (params.safetensors' tensors and their shapes,
    states.safetensors' tensor names and the parameter each belongs to)."""
    params = {
        entry["path"]: list(entry["shape"])
        for entry in experiment["params"]
        if entry.get("load") is None or entry["trainable"]
    }
    states = {
        f"{path}/{name}": path
        for path, names in experiment.get("states", {}).items()
        for name in names
    }
    return params, states


def _check_names(header: Mapping[str, Any], expected: set[str], where: str, what: str) -> None:
    for name in header:
        parts = name.split("/")
        if not all(_PATH_PART.match(p) for part in parts for p in part.split(".")) or len(parts) > (
            2 if what == "state" else 1
        ):
            raise CheckpointError(
                f"{where} has a tensor named {name!r}, which is no {what} name", code=E_FOREIGN
            )
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


def _read_tensor_file(storage: Storage, key: str, name: str) -> tuple[dict[str, np.ndarray], str]:
    """A checkpoint's tensor file, decoded, and where it is (for messages)."""
    file_key = _join(key, name)
    where = location_of(storage, file_key)
    return decode_safetensors(_read_part(storage, file_key), where), where


def load_checkpoint(storage: Storage, key: str, *, with_states: bool = True) -> Loaded:
    """Read the checkpoint at ``key`` and check everything before handing it over.

    Refuses (with :class:`sexpgpu.errors.CheckpointError`, never a fresh start)
    a checkpoint that is incomplete, has a file missing, truncated or not
    parseable, is from a newer format, or whose tensors' names, shapes or
    dtypes are not the ones ``experiment.json`` declares. ``with_states=False``
    skips ``states.safetensors`` (evaluation never needs it).
    """
    experiment = read_experiment(storage, key)
    state = read_state(storage, key)
    want_params, want_states = expected_tensors(experiment)
    shapes = {entry["path"]: entry["shape"] for entry in experiment["params"]}

    params, where = _read_tensor_file(storage, key, PARAMS_FILE)
    _check_names(params, set(want_params), where, "parameter")
    for name, array in params.items():
        if array.dtype.name != "float32":
            raise _damaged(where, f"{name} is {array.dtype}, where a parameter is stored as F32")
        if list(array.shape) != want_params[name]:
            raise _damaged(
                where,
                f"{name} has the shape {list(array.shape)}, "
                f"where experiment.json says {want_params[name]}",
            )

    states: dict[str, np.ndarray] = {}
    if with_states:
        states, where = _read_tensor_file(storage, key, STATES_FILE)
        _check_names(states, set(want_states), where, "state")
        for name, array in states.items():
            shape = shapes[want_states[name]]
            # A state is per parameter: its shape is the parameter's, or a scalar.
            if list(array.shape) not in (shape, []):
                raise _damaged(
                    where,
                    f"{name} has the shape {list(array.shape)}, where its parameter is {shape}",
                )
    return Loaded(location_of(storage, key), experiment, state, params, states)


# ------------------------------------------------------------------ resuming


def _short(sha256: str | None) -> str:
    return sha256[:12] if sha256 else "-"


def _show(value: Any) -> str:
    """A knob's value as the user would write it in a `.sx` file."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + " ".join(_show(v) for v in value) + "]"
    return str(value)


def compare_for_resume(
    recorded: Mapping[str, Any],
    program: Program,
    *,
    devices: int,
    nodes: int,
    state_names: Mapping[str, tuple[str, ...]],
) -> list[str]:
    """Check that ``program`` can continue from a checkpoint's ``experiment.json``.

    Raises :class:`CheckpointError` with ``E-DP-002`` for another device or node
    count, and with ``E-CKPT-004`` naming every parameter that is new, gone, of
    another shape or dtype, trains where it was frozen (or the reverse), or
    keeps other optimizer states. Returns what moved, one line each, for the
    ``resumed from`` annotation: ``source <name> <old> -> <new>`` (12 hex digits
    of the sha256, ``-`` for a file new or gone) and ``knob <name> <old> -> <new>``.
    """
    old_devices, old_nodes = int(recorded.get("devices", 1)), int(recorded.get("nodes", 1))
    if (old_devices, old_nodes) != (devices, nodes):
        raise CheckpointError(
            f"the checkpoint was written by {_devices(old_devices, old_nodes)} and this run "
            f"has {_devices(devices, nodes)}; resume with the same device and node count",
            code="E-DP-002",
        )

    problems: list[str] = []
    old = {entry["path"]: entry for entry in recorded["params"]}
    new = {param.path: param for param in program.params}
    old_states = recorded.get("states", {})
    for path, param in new.items():
        if path not in old:
            problems.append(f"{path}: new (not in the checkpoint)")
            continue
        entry, said = old[path], []
        shape = list(param.type.shape)
        if list(entry["shape"]) != shape:
            said.append(f"shape {_shape(entry['shape'])} -> {_shape(shape)}")
        if entry["dtype"] != param.type.dtype:
            said.append(f"dtype {entry['dtype']} -> {param.type.dtype}")
        if entry["trainable"] != param.trainable:
            said.append("frozen -> trains" if param.trainable else "trains -> frozen")
        elif param.trainable:
            before = tuple(old_states.get(path, ()))
            after = tuple(state_names.get(path, ()))
            if before != after:
                said.append(f"optimizer states {_names(before)} -> {_names(after)}")
        if said:
            problems.append(f"{path}: " + ", ".join(said))
    for path in old:
        if path not in new:
            problems.append(f"{path}: gone (in the checkpoint, not in this program)")
    if problems:
        raise CheckpointError(
            "this program's parameters are not the checkpoint's:\n"
            + "\n".join(f"  {line}" for line in problems)
            + "\nresume with the program that wrote the checkpoint, or start the run again",
            code=E_CHANGED,
        )

    moved: list[str] = []
    old_sources = {s["name"]: s.get("sha256") for s in recorded.get("sources", [])}
    new_sources = {s.name: s.sha256 for s in program.sources}
    for name in [*old_sources, *(n for n in new_sources if n not in old_sources)]:
        before, after = old_sources.get(name), new_sources.get(name)
        if before != after:
            moved.append(f"source {name} {_short(before)} -> {_short(after)}")
    old_knobs = {k["name"]: k.get("value") for k in recorded.get("knobs", [])}
    new_knobs = {k.name: _jsonable(k.value) for k in program.knobs}
    for name in [*old_knobs, *(n for n in new_knobs if n not in old_knobs)]:
        before, after = old_knobs.get(name), new_knobs.get(name)
        if name not in old_knobs or name not in new_knobs or not _same(before, after):
            shown_before = _show(before) if name in old_knobs else "-"
            shown_after = _show(after) if name in new_knobs else "-"
            moved.append(f"knob {name} {shown_before} -> {shown_after}")
    return moved


def _same(a: Any, b: Any) -> bool:
    # 4 and 4.0 are the same knob value; True and 1 are not.
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _devices(devices: int, nodes: int) -> str:
    text = f"{devices} device{'s' if devices != 1 else ''}"
    return f"{text} on {nodes} node{'s' if nodes != 1 else ''}"


def _shape(shape: Any) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def _names(names: tuple[str, ...]) -> str:
    return ", ".join(names) if names else "none"


# ------------------------------------------------------------------ describing


def _version(version: Any) -> str:
    text = str(version)
    # A local file's sha256 is told by its first 8 hex digits, as git tells commits.
    if text.startswith("sha256:") and len(text) > 15:
        return text[:15] + "..."
    return text


def _table(rows: list[tuple[str, ...]], indent: str = "  ", least: int = 0) -> list[str]:
    """Rows with every column but the last padded to its widest cell (at least
    ``least`` wide) plus two spaces."""
    if not rows:
        return []
    widths = [max(least, *(len(row[i]) for row in rows)) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)] + [
            row[-1]
        ]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def describe_checkpoint(storage: Storage, key: str) -> str:
    """What ``sexpgpu checkpoint`` prints: the checkpoint's identity, its step and
    every tensor's name, dtype and shape.

    Reads only ``experiment.json``, ``state.json`` and the two safetensors
    headers (by ranged reads), never tensor data. A location without
    ``experiment.json`` is an error.
    """
    experiment = read_experiment(storage, key)
    state = read_state(storage, key)
    label = 11  # "precision" and two spaces: the console layout of docs/checkpoints.md
    devices = str(experiment.get("devices", 1))
    if int(experiment.get("nodes", 1)) != 1:
        devices += f" on {experiment['nodes']} nodes"
    lines = [f"checkpoint {location_of(storage, key)}"]
    for name, value in (
        ("step", state["step"]),
        ("sexpgpu", experiment.get("sexpgpu", "?")),
        ("variant", experiment.get("variant", "-")),
        ("devices", devices),
        ("precision", experiment.get("precision", "?")),
        ("seed", experiment.get("seed", "?")),
        ("counters", ", ".join(experiment.get("counters", [])) or "-"),
    ):
        lines.append(f"{name.ljust(label)}{value}")
    lines.append("sources")
    # Names get 24 columns at least, as in the spec's console example.
    lines += _table(
        [(s.get("name", "?"), str(s.get("sha256", "?"))) for s in experiment["sources"]],
        least=24,
    )
    lines.append(f"{'slug'.ljust(label)}{experiment['slug']}")
    lines.append(f"{'finished'.ljust(label)}{'true' if experiment.get('finished') else 'false'}")
    lines.append("knobs")
    lines += _table(
        [
            (str(k.get("name")), _show(k.get("value")), str(k.get("source", "")))
            for k in experiment["knobs"]
        ]
    )
    lines.append("choices")
    lines += _table([(site, str(name)) for site, name in experiment["choices"].items()])
    lines.append("loaded")
    loaded_rows = []
    for entry in experiment["params"]:
        load = entry.get("load")
        if load is None:
            continue
        size = load.get("size")
        text = f"{load.get('tensor')} in {load['uri']}"
        if size is not None:
            text += f", {size} bytes"
        if load.get("version") is not None:
            text += f", {_version(load['version'])}"
        loaded_rows.append((entry["path"], text))
    lines += _table(loaded_rows)

    declared = {entry["path"]: entry for entry in experiment["params"]}
    want_params, want_states = expected_tensors(experiment)
    for file, order in ((PARAMS_FILE, list(want_params)), (STATES_FILE, list(want_states))):
        header = read_header(storage, _join(key, file))
        names = [n for n in order if n in header] + sorted(n for n in header if n not in order)
        count = len(names)
        lines.append(f"{file}  {count} tensor{'' if count == 1 else 's'}")
        rows = []
        for name in names:
            entry = header[name]
            suffix = []
            param = declared.get(name) if file == PARAMS_FILE else None
            if param is not None:
                if not param["trainable"]:
                    suffix.append("frozen")
                if param.get("tags"):
                    suffix.append(", ".join(param["tags"]))
            rows.append((name, entry["dtype"], "  ".join([_shape(entry["shape"]), *suffix])))
        lines += _table(rows)
    return "\n".join(lines) + "\n"
