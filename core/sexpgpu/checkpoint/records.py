"""The two JSON records of a checkpoint: what ``experiment.json`` and ``state.json``
hold, made from a program and a run's position, and checked when read back, and
how their values are written in messages (as a user writes them in a `.sx` file).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sexpgpu.checkpoint.keys import E_FOREIGN, FORMAT, damaged, is_count
from sexpgpu.errors import CheckpointError

if TYPE_CHECKING:
    from sexpgpu.graph import Program

# One component of a dotted parameter path: no separators, no whitespace, no
# control characters; splitting on "." already rules out "" and "..".
_PATH_PART = re.compile(r"^[^\s/\\.\x00-\x1f\x7f]+$")
_STATE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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


def _check_params(params: Any, where: str) -> set[str]:
    """The paths of ``experiment.json``'s params list, each entry checked."""
    if not isinstance(params, list):
        raise _foreign(where, "it has no params list")
    seen = set()
    for entry in params:
        if not isinstance(entry, dict):
            raise _foreign(where, "a params entry is not an object")
        path = _check_path(entry.get("path"), where)
        if path in seen:
            raise _foreign(where, f"{path} is listed twice")
        seen.add(path)
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(is_count(n) for n in shape):
            raise _foreign(where, f"{path} has no shape")
        if entry.get("dtype") not in ("f32", "bf16"):
            raise _foreign(where, f"{path} has the dtype {entry.get('dtype')!r}")
        if not isinstance(entry.get("trainable"), bool):
            raise _foreign(where, f"{path} does not say whether it trains")
        tags = entry.get("tags", [])
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise _foreign(where, f"{path} has tags that are not names")
        load = entry.get("load")
        if load is not None and not (isinstance(load, dict) and isinstance(load.get("uri"), str)):
            raise _foreign(where, f"{path} has a load that names no file")
    return seen


def check_experiment(record: Any, where: str) -> dict[str, Any]:
    """``record`` (the JSON of the ``experiment.json`` at ``where``) if it is one this
    sexpgpu reads; otherwise :class:`CheckpointError` (``E-CKPT-003``) saying why."""
    _check_format(record, where)
    seen = _check_params(record.get("params"), where)
    states = record.get("states", {})
    if not isinstance(states, dict):
        raise _foreign(where, "its states are not an object")
    for path, names in states.items():
        if path not in seen:
            raise _foreign(where, f"it has states for {path!r}, which is not one of its parameters")
        if not isinstance(names, list) or not all(
            isinstance(n, str) and _STATE_NAME.match(n) for n in names
        ):
            raise _foreign(where, f"the state names of {path} are not names")
    for name, kind in (("sources", list), ("knobs", list), ("choices", dict), ("slug", str)):
        if not isinstance(record.get(name), kind):
            raise _foreign(where, f"it has no {name}")
    for name in ("devices", "nodes"):
        if not is_count(record.get(name, 1)):
            raise _foreign(where, f"its {name} is not a count")
    return record


def check_state(state: Any, where: str) -> dict[str, Any]:
    """``state`` (the JSON of the ``state.json`` at ``where``) if it is whole; otherwise
    :class:`CheckpointError` (``E-CKPT-002``) saying what is wrong."""
    if not isinstance(state, dict):
        raise damaged(where, "it is not a JSON object")
    for name in ("step", "stage", "records", "seed"):
        value = state.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or (name != "seed" and value < 0):
            raise damaged(where, f"its {name} is not a whole number")
    counters = state.get("counters", {})
    if not isinstance(counters, dict) or not all(is_count(v) for v in counters.values()):
        raise damaged(where, "its counters are not counts")
    if state.get("loader") is not None and not isinstance(state["loader"], dict):
        raise damaged(where, "its loader position is not a JSON object")
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
