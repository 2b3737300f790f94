"""The resume policy: whether a program may continue from a checkpoint, and what
moved since it was written.

Refused: another device or node count (``E-DP-002``), and parameters that are
new, gone, of another shape or dtype, that train where they were frozen (or the
reverse), or that keep other optimizer states (``E-CKPT-004``). Allowed and
recorded for the ``resumed from`` lines: changed sources and knobs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sexpgpu.checkpoint.keys import E_CHANGED
from sexpgpu.checkpoint.records import jsonable, shape_text, source_place, value_text
from sexpgpu.errors import CheckpointError, StorageError

if TYPE_CHECKING:
    from sexpgpu.checkpoint.read import Loaded
    from sexpgpu.extension import Storage
    from sexpgpu.lang.ir import Program

E_DEVICES = "E-DP-002"
"""A resume on another device or node count than the checkpoint's."""


def compare_for_resume(
    recorded: Mapping[str, Any],
    program: Program,
    *,
    devices: int,
    nodes: int,
    state_names: Mapping[str, tuple[str, ...]],
    root: str | None = None,
) -> list[str]:
    """Check that ``program`` can continue from a checkpoint's ``experiment.json``.

    Raises :class:`CheckpointError` with ``E-DP-002`` for another device or node
    count, and with ``E-CKPT-004`` naming every parameter that is new, gone, of
    another shape or dtype, trains where it was frozen (or the reverse), or
    keeps other optimizer states. Returns what moved, one line each, for the
    ``resumed from`` annotation: ``source <name> <old> -> <new>`` (12 hex digits
    of the sha256, ``-`` for a file new or gone; for the same bytes moved into or out
    of a bundle, its paths: ``root`` is the folder of the source ``program`` was
    opened from, see :func:`~sexpgpu.checkpoint.records.source_place`) and ``knob <name> <old>
    -> <new>``.
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
    return _moved_sources(recorded, program, root) + _moved_knobs(recorded, program)


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


def _moved_sources(recorded: Mapping[str, Any], program: Program, root: str | None) -> list[str]:
    old = {s["name"]: s for s in recorded.get("sources", [])}
    new = {s.name: s for s in program.sources}
    moved = []
    for name in [*old, *(n for n in new if n not in old)]:
        before = old[name].get("sha256") if name in old else None
        after = new[name].sha256 if name in new else None
        if before != after:
            moved.append(f"source {name} {_short(before)} -> {_short(after)}")
            continue
        was, now = old[name].get("path"), source_place(new[name].path, root)
        # a bundle's sources are its own paths: the same bytes there and in the project
        # are listed by path; a project moved between folders is not
        if was and now and was != now and not (os.path.isabs(was) and os.path.isabs(now)):
            moved.append(f"source {name} {_escaped(was)} -> {_escaped(now)}")
    return moved


def _escaped(text: str) -> str:
    """``text`` with its control characters escaped: one annotation line stays one."""
    return text if text.isprintable() else ascii(text)[1:-1]


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


def check_position(state: Mapping[str, Any], program: Program, where: str) -> None:
    """Nothing when ``state`` (a checkpoint's ``state.json``, its schema checked) is a
    position in ``program``: its stage exists and every pass it owes is one of the
    program's. Otherwise :class:`CheckpointError` (``E-CKPT-004``) naming the field."""
    stages = len(program.stages)
    if state["stage"] >= stages:
        raise CheckpointError(
            f"{where} is at stage {state['stage']}, and this program has {stages} "
            f"stage{'s' if stages != 1 else ''}; resume with the program that wrote it",
            code=E_CHANGED,
        )
    known = {eval_pass.name for eval_pass in program.evals}
    unknown = [name for name in state.get("evals_pending", []) if name not in known]
    if unknown:
        raise CheckpointError(
            f"{where} owes the evaluation pass {unknown[0]!r}, which this program does not "
            "have; resume with the program that wrote it",
            code=E_CHANGED,
        )


def load_for_resume(storage: Storage, key: str, program: Program, *, latest: bool) -> Loaded:
    """The checkpoint at ``key`` read and verified for ``program`` to continue it
    (:func:`~sexpgpu.checkpoint.load_checkpoint`, then :func:`check_position`).

    With ``latest`` (the key ``--resume latest`` found), a checkpoint that cannot be
    read is refused with its error, which then also names the complete checkpoint
    before it that the user may pass to ``--resume``: never a silent fall-back.
    """
    from sexpgpu.checkpoint.find import latest_damaged
    from sexpgpu.checkpoint.keys import STATE_FILE, file_key, location_of
    from sexpgpu.checkpoint.read import load_checkpoint

    try:
        loaded = load_checkpoint(storage, key, with_states=True)
    except (CheckpointError, StorageError) as error:
        if not latest or error.code == E_CHANGED:
            raise
        raise latest_damaged(storage, key, error) from None
    check_position(loaded.state, program, location_of(storage, file_key(key, STATE_FILE)))
    return loaded


E_LOAD_CHANGED = "E-LOAD-001"
"""A resume whose ``:load`` file is not the bytes the checkpoint's run read."""


def compare_loads(recorded: Mapping[str, Any], found: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Check the files this run's ``:load`` parameters were read from (``found``: each
    path's ``{"uri", "tensor", "size", "version"}``) against the ones a checkpoint's
    ``experiment.json`` pinned.

    Raises :class:`CheckpointError` (``E-LOAD-001``) with one line per parameter
    whose file has other bytes (size or version), whose tensor is another, or that
    is read from a file in one and not the other. Returns one ``load <path> <old>
    -> <new>`` line per file found with the same bytes at another path.
    """
    refused, moved = [], []
    for entry in recorded["params"]:
        old, path = entry.get("load"), entry["path"]
        new = found.get(path)
        if old is None and new is None:
            continue
        same = (
            old is not None
            and new is not None
            and (old.get("size"), old.get("version"), old.get("tensor"))
            == (new["size"], new["version"], new["tensor"])
        )
        if not same:
            refused.append(f"  {path}: {_pinned(old)} -> {_pinned(new)}")
        elif old.get("uri") != new["uri"]:
            moved.append(f"load {path} {old.get('uri')} -> {new['uri']}")
    if refused:
        raise CheckpointError(
            "a loaded parameter's file is not the one the checkpoint's run read:\n"
            + "\n".join(refused)
            + "\nrestore that file, or start the run again",
            code=E_LOAD_CHANGED,
        )
    return moved


def _pinned(load: Mapping[str, Any] | None) -> str:
    if load is None:
        return "not read from a file"
    return (
        f"{load.get('tensor')} in {load.get('uri')}, {load.get('size')} bytes, "
        f"{load.get('version')}"
    )
