"""The resume policy: whether a program may continue from a checkpoint, and what
moved since it was written.

Refused: another device or node count (``E-DP-002``), and parameters that are
new, gone, of another shape or dtype, that train where they were frozen (or the
reverse), or that keep other optimizer states (``E-CKPT-004``). Allowed and
recorded for the ``resumed from`` lines: changed sources and knobs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sexpgpu.checkpoint.keys import E_CHANGED
from sexpgpu.checkpoint.records import jsonable, shape_text, value_text
from sexpgpu.errors import CheckpointError

if TYPE_CHECKING:
    from sexpgpu.graph import Program

E_DEVICES = "E-DP-002"
"""A resume on another device or node count than the checkpoint's."""


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
            code=E_DEVICES,
        )
    problems = _param_problems(recorded, program, state_names)
    if problems:
        raise CheckpointError(
            "this program's parameters are not the checkpoint's:\n"
            + "\n".join(f"  {line}" for line in problems)
            + "\nresume with the program that wrote the checkpoint, or start the run again",
            code=E_CHANGED,
        )
    return _moved_sources(recorded, program) + _moved_knobs(recorded, program)


def _param_problems(
    recorded: Mapping[str, Any], program: Program, state_names: Mapping[str, tuple[str, ...]]
) -> list[str]:
    """One line per parameter that keeps ``program`` from continuing the checkpoint."""
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
            said.append(f"shape {shape_text(entry['shape'])} -> {shape_text(shape)}")
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
    return problems


def _moved_sources(recorded: Mapping[str, Any], program: Program) -> list[str]:
    old = {s["name"]: s.get("sha256") for s in recorded.get("sources", [])}
    new = {s.name: s.sha256 for s in program.sources}
    moved = []
    for name in [*old, *(n for n in new if n not in old)]:
        before, after = old.get(name), new.get(name)
        if before != after:
            moved.append(f"source {name} {_short(before)} -> {_short(after)}")
    return moved


def _moved_knobs(recorded: Mapping[str, Any], program: Program) -> list[str]:
    old = {k["name"]: k.get("value") for k in recorded.get("knobs", [])}
    new = {k.name: jsonable(k.value) for k in program.knobs}
    moved = []
    for name in [*old, *(n for n in new if n not in old)]:
        before, after = old.get(name), new.get(name)
        if name not in old or name not in new or not _same(before, after):
            shown_before = value_text(before) if name in old else "-"
            shown_after = value_text(after) if name in new else "-"
            moved.append(f"knob {name} {shown_before} -> {shown_after}")
    return moved


def _short(sha256: str | None) -> str:
    return sha256[:12] if sha256 else "-"


def _same(a: Any, b: Any) -> bool:
    # 4 and 4.0 are the same knob value; True and 1 are not.
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _devices(devices: int, nodes: int) -> str:
    text = f"{devices} device{'s' if devices != 1 else ''}"
    return f"{text} on {nodes} node{'s' if nodes != 1 else ''}"


def _names(names: tuple[str, ...]) -> str:
    return ", ".join(names) if names else "none"
