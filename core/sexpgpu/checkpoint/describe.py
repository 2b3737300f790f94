"""What a checkpoint is, as data: its identity, step, knobs, choices, the files its
``:load`` parameters were read from, and every tensor's header, read from the two
records and the two safetensors headers only (never tensor data).

``sexpgpu checkpoint`` lays this out as text; that layout is the CLI's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sexpgpu.checkpoint.keys import PARAMS_FILE, STATES_FILE, file_key, location_of
from sexpgpu.checkpoint.read import (
    foreign_tensor,
    read_experiment,
    read_header,
    read_state,
)
from sexpgpu.checkpoint.records import expected_tensors

if TYPE_CHECKING:
    from sexpgpu.extension import Storage


@dataclass(frozen=True)
class SourceRecord:
    """One source file of the run: its name and the sha256 of its text, as recorded."""

    name: str
    sha256: str


@dataclass(frozen=True)
class KnobRecord:
    """One knob: its name, its value as recorded (JSON) and where the value came from."""

    name: str
    value: Any
    source: str


@dataclass(frozen=True)
class LoadRecord:
    """A ``:load`` parameter and the file it was read from (size and version when known)."""

    path: str
    tensor: str | None
    uri: str
    size: int | None
    version: str | None


@dataclass(frozen=True)
class TensorHeader:
    """One tensor of a safetensors file, from its header: name, dtype (``F32``...) and
    shape; for a parameter, whether it is frozen and its tags."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    frozen: bool = False
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class TensorFile:
    """A tensor file of the checkpoint and its tensors: the ones ``experiment.json``
    declares in its order, then any others by name."""

    name: str
    tensors: tuple[TensorHeader, ...]


@dataclass(frozen=True)
class CheckpointDescription:
    """What ``sexpgpu checkpoint`` shows. Values a record does not hold are ``"?"``
    (``"-"`` for the variant), as the layout of docs/checkpoints.md shows them."""

    location: str
    step: int
    sexpgpu: str
    variant: str
    devices: int
    nodes: int
    precision: str
    seed: Any
    counters: tuple[str, ...]
    sources: tuple[SourceRecord, ...]
    slug: str
    finished: bool
    knobs: tuple[KnobRecord, ...]
    choices: tuple[tuple[str, str], ...]
    loaded: tuple[LoadRecord, ...]
    files: tuple[TensorFile, ...]
    problems: tuple[str, ...] = ()
    """Where the tensor headers disagree with ``experiment.json``, one line each (the
    checks a resume makes of the tensors, less their bytes); empty when they agree."""
    foreign: str | None = None
    """The first tensor name sexpgpu never writes, said as a resume says it (the
    damage is then ``E-CKPT-003``, as to a resume); ``None`` when there is none."""


def describe_checkpoint(storage: Storage, key: str) -> CheckpointDescription:
    """The description of the checkpoint at ``key``, every record checked as reading
    it would; reads ``experiment.json``, ``state.json`` and the two safetensors
    headers (by ranged reads), never tensor data. A location without
    ``experiment.json`` is an error (``E-CKPT-001``)."""
    experiment = read_experiment(storage, key)
    state = read_state(storage, key, experiment)
    files, problems, foreign = _tensor_files(storage, key, experiment)
    return CheckpointDescription(
        location=location_of(storage, key),
        step=state["step"],
        sexpgpu=str(experiment.get("sexpgpu", "?")),
        variant=str(experiment.get("variant", "-")),
        devices=experiment.get("devices", 1),
        nodes=experiment.get("nodes", 1),
        precision=str(experiment.get("precision", "?")),
        seed=experiment.get("seed", "?"),
        counters=tuple(experiment.get("counters", [])),
        sources=tuple(
            SourceRecord(s.get("name", "?"), str(s.get("sha256", "?")))
            for s in experiment["sources"]
        ),
        slug=experiment["slug"],
        finished=bool(experiment.get("finished")),
        knobs=tuple(
            KnobRecord(str(k.get("name")), k.get("value"), str(k.get("source", "")))
            for k in experiment["knobs"]
        ),
        choices=tuple((site, str(name)) for site, name in experiment["choices"].items()),
        loaded=_loaded(experiment),
        files=files,
        problems=problems,
        foreign=foreign[0] if foreign else None,
    )


def _loaded(experiment: dict[str, Any]) -> tuple[LoadRecord, ...]:
    rows = []
    for entry in experiment["params"]:
        load = entry.get("load")
        if load is not None:
            version = load.get("version")
            rows.append(
                LoadRecord(
                    path=entry["path"],
                    tensor=load.get("tensor"),
                    uri=load["uri"],
                    size=load.get("size"),
                    version=None if version is None else str(version),
                )
            )
    return tuple(rows)


def _tensor_files(
    storage: Storage, key: str, experiment: dict[str, Any]
) -> tuple[tuple[TensorFile, ...], tuple[str, ...], list[str]]:
    """Each tensor file's tensors from its header, and where they disagree with
    ``experiment.json``."""
    declared = {entry["path"]: entry for entry in experiment["params"]}
    want_params, want_states = expected_tensors(experiment)
    state_shapes = {name: want_params.get(path) for name, path in want_states.items()}
    files, problems, foreign = [], [], []
    for file, wanted in ((PARAMS_FILE, want_params), (STATES_FILE, state_shapes)):
        header = read_header(storage, file_key(key, file))
        what = "parameter" if file == PARAMS_FILE else "state"
        said = foreign_tensor(header, what)
        if said is not None and not foreign:
            foreign.append(f"{file} {said}")
        order = list(wanted)
        names = [n for n in order if n in header] + sorted(n for n in header if n not in order)
        problems += _header_problems(file, header, wanted)
        tensors = []
        for name in names:
            param = declared.get(name) if file == PARAMS_FILE else None
            tensors.append(
                TensorHeader(
                    name=name,
                    dtype=header[name]["dtype"],
                    shape=tuple(header[name]["shape"]),
                    frozen=param is not None and not param["trainable"],
                    tags=tuple(param.get("tags") or ()) if param is not None else (),
                )
            )
        files.append(TensorFile(file, tuple(tensors)))
    return tuple(files), tuple(problems), foreign


def _header_problems(file: str, header: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """What a resume would refuse in a tensor file, told from its header alone."""
    problems = [f"{file}: {name} is missing" for name in wanted if name not in header]
    for name, entry in header.items():
        if name not in wanted:
            problems.append(f"{file}: {name} is not in experiment.json")
            continue
        if entry["dtype"] != "F32":
            problems.append(f"{file}: {name} is {entry['dtype']}, where every tensor is F32")
        shape, want = list(entry["shape"]), wanted[name]
        # A state is per parameter: its shape is the parameter's, or a scalar.
        if want is not None and shape != want and not (file == STATES_FILE and shape == []):
            problems.append(f"{file}: {name} has the shape {shape}, where it should be {want}")
    return problems
