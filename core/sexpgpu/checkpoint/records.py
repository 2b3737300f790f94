"""The two JSON records of a checkpoint: what ``experiment.json`` and ``state.json``
hold, made from a program and a run's position, and checked when read back, and
how their values are written in messages (as a user writes them in a `.sx` file).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sexpgpu.checkpoint.keys import E_FOREIGN, FORMAT, damaged, is_count
from sexpgpu.checkpoint.schema import EXPERIMENT_SCHEMA, STATE_SCHEMA, violation
from sexpgpu.errors import CheckpointError

if TYPE_CHECKING:
    from sexpgpu.lang.ir import Program

# One component of a dotted parameter path: no separators, no whitespace, no
# control characters; splitting on "." already rules out "" and "..".
_PATH_PART = re.compile(r"^[^\s/\\.\x00-\x1f\x7f]+$")


def jsonable(value: Any) -> Any:
    """A knob's value as JSON: tuples become lists, anything exotic its text."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    return str(value)


def source_place(path: str | None, root: str | None) -> str | None:
    """Where a source file is, as ``experiment.json`` records it: its path in the folder
    ``root`` of the source the program was opened from, a bundle unpacked
    (``sources/run.sx``: the same for every run of the bundle, wherever unpacked), else
    its real, absolute path; ``None`` for the ``<core>`` prelude."""
    if path is None:
        return None
    real = os.path.realpath(path)
    if root is not None:
        folder = os.path.realpath(root)
        if os.path.commonpath([real, folder]) == folder:
            return os.path.relpath(real, folder).replace(os.sep, "/")
    return real


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
    root: str | None = None,
) -> dict[str, Any]:
    """The content of ``experiment.json``: what the run is, as docs/checkpoints.md lists.

    ``state_names`` maps each parameter path to the optimizer states the current
    stage keeps for it (``OptimizerInfo.state_names(options)``; frozen ones have
    none). ``loaded`` maps a ``:load`` parameter's path to the identity of the
    file it was read from (``{"size": int, "version": str}``, and ``uri``/``tensor``
    when they differ from the declaration, e.g. the shard of an index). ``root``: the
    folder of the source the program was opened from (each source's ``path`` is then
    its path there, :func:`source_place`).
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
            # the file's identity is what a resume compares: no entry without it
            pinned = loaded[param.path]
            entry["load"] = {
                "uri": pinned.get("uri", param.load.uri),
                "tensor": pinned.get("tensor", param.load.tensor),
                "size": pinned["size"],
                "version": pinned["version"],
            }
        params.append(entry)
    return {
        "format": FORMAT,
        "sexpgpu": __version__,
        "run": program.run.name,
        "file": program.file,
        "slug": slug,
        "finished": bool(finished),
        "sources": [_source_record(s, root) for s in program.sources],
        "variant": program.variant or "-",
        "knobs": [
            {"name": k.name, "value": jsonable(k.value), "source": k.source} for k in program.knobs
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


def _source_record(source: Any, root: str | None) -> dict[str, Any]:
    place = source_place(source.path, root)
    record = {"name": source.name, "sha256": source.sha256}
    return record if place is None else {**record, "path": place}


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
        "loader": jsonable(dict(loader)) if loader is not None else None,
        "seed": int(seed),
        "evals_pending": [str(name) for name in evals_pending],
    }


def value_text(value: Any) -> str:
    """A recorded knob value as the user would write it in a `.sx` file (``-``: none)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + " ".join(value_text(v) for v in value) + "]"
    return str(value)


def command_line_knobs(experiment: Mapping[str, Any]) -> tuple[dict[str, str], int | None]:
    """The knobs a checkpoint's command line set, as ``--set`` takes them, and its
    ``--steps``: what compiles its program again under the same selection."""
    sets: dict[str, str] = {}
    steps = None
    for knob in experiment.get("knobs", []):
        if knob.get("source") != "command line":
            continue
        if knob["name"] == "steps" and isinstance(knob["value"], int):
            steps = knob["value"]
        else:
            sets[knob["name"]] = _set_text(knob["value"])
    return sets, steps


def _set_text(value: Any) -> str:
    """A recorded knob value as ``--set`` takes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else json.dumps(value)


def shape_text(shape: Any) -> str:
    """A shape as messages and ``sexpgpu checkpoint`` write it: ``[32, 8]``."""
    return "[" + ", ".join(str(n) for n in shape) + "]"


def is_dotted_path(path: Any) -> bool:
    """Whether ``path`` is a parameter's dotted path (``model.blocks.0.w``), with no
    separator, whitespace, control character or empty part."""
    return isinstance(path, str) and all(_PATH_PART.match(p) for p in path.split("."))


def _check_path(path: Any, where: str) -> str:
    if not is_dotted_path(path):
        raise CheckpointError(
            f"{where} names a parameter {path!r} that is not a dotted path", code=E_FOREIGN
        )
    return path


def _foreign(where: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where} is not a sexpgpu checkpoint's: {what}", code=E_FOREIGN)


def _check_format(record: Any, where: str) -> None:
    if not isinstance(record, dict) or not is_count(record.get("format")):
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


def _check_params(params: list[dict[str, Any]], where: str) -> set[str]:
    """The paths of ``experiment.json``'s params list (its schema already checked), each a
    dotted path listed once."""
    seen = set()
    for entry in params:
        path = _check_path(entry["path"], where)
        if path in seen:
            raise _foreign(where, f"{path} is listed twice")
        seen.add(path)
    return seen


def check_experiment(record: Any, where: str) -> dict[str, Any]:
    """``record`` (the JSON of the ``experiment.json`` at ``where``) if it is one this
    sexpgpu reads: its format, then its schema (:data:`~sexpgpu.checkpoint.schema.EXPERIMENT_SCHEMA`),
    then what a schema cannot say. Otherwise :class:`CheckpointError` (``E-CKPT-003``)."""
    _check_format(record, where)
    said = violation(record, EXPERIMENT_SCHEMA)
    if said is not None:
        raise _foreign(where, said)
    seen = _check_params(record["params"], where)
    for path in record.get("states", {}):
        if path not in seen:
            raise _foreign(where, f"it has states for {path!r}, which is not one of its parameters")
    return record


def check_state(state: Any, where: str, *, step: int | None = None) -> dict[str, Any]:
    """``state`` (the JSON of the ``state.json`` at ``where``) if it fits
    :data:`~sexpgpu.checkpoint.schema.STATE_SCHEMA` and, when the folder names one,
    holds the folder's ``step``; otherwise :class:`CheckpointError` (``E-CKPT-002``)."""
    if not isinstance(state, dict):
        raise damaged(where, "it is not a JSON object")
    said = violation(state, STATE_SCHEMA)
    if said is not None:
        raise damaged(where, said)
    if step is not None and state["step"] != step:
        raise damaged(
            where, f"its step is {state['step']}, where its folder is the checkpoint of step {step}"
        )
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
