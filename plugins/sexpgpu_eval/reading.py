"""Reading a checkpoint for evaluation: as a resume does, less.

``experiment.json`` (the file compiled under its variant and knobs, its
parameters checked, its choices taken, its metrics experiment found by
``slug``), ``state.json`` (step, stage, counters) and ``params.safetensors``,
each verified against its checksum. Never ``states.safetensors``, never the
training loader, and nothing is written into the checkpoint: which is why another
lowering than the recorded one (``--lowering``) may evaluate it, choosing its
kernels afresh, without ``--choices fresh``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sexpgpu.checkpoint import check_position, compare_for_resume, load_checkpoint, location_of
from sexpgpu.errors import CheckpointError, SexpError
from sexpgpu.extension import Storage, Trainer
from sexpgpu.graph import Program
from sexpgpu.kernels import LOWERING_CHOICE, with_lowering

E_EVAL_FOREIGN = "E-EVAL-002"
"""A checkpoint whose run is not the program compiled for it (another program's)."""


@dataclass
class Opened:
    """A checkpoint ready to evaluate: its records, its compiled program, and a
    trainer holding its parameters."""

    location: str
    step: int
    finished: bool
    slug: str
    program: Program
    trainer: Trainer
    moved: list[str]


def _value_text(value: Any) -> str:
    """A recorded knob value as ``--set`` takes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else json.dumps(value)


def compile_recorded(experiment: dict[str, Any], file: str | None) -> Program:
    """The checkpoint's program: its file (or ``file``) compiled under its variant and
    the knobs its command line set, as a resume compiles it."""
    from sexpgpu.lang import compile_file

    sets: dict[str, str] = {}
    steps = None
    for knob in experiment.get("knobs", []):
        if knob.get("source") != "command line":
            continue
        if knob["name"] == "steps" and isinstance(knob["value"], int):
            steps = knob["value"]
        else:
            sets[knob["name"]] = _value_text(knob["value"])
    variant = experiment.get("variant")
    return compile_file(
        file or experiment["file"],
        sets=sets,
        variant=None if variant in (None, "-") else variant,
        steps=steps,
    )


class CheckpointReader:
    """Opens checkpoints for evaluation; a program and its lowering are built once per
    distinct identity (sources, knobs, variant, choices), since a follower reads many."""

    def __init__(self, *, device: str, file: str | None, lowering: str | None = None) -> None:
        self.device = device
        self.file = file
        self.lowering = lowering
        """``--lowering``: evaluate with this lowering (default: the recorded one)."""
        self._built: dict[str, tuple[Program, Trainer, list[str]]] = {}
        self._programs: dict[str, Program] = {}

    def open(self, storage: Storage, key: str) -> Opened:
        """Read and verify the checkpoint at ``key``; raises a one-line SexpError."""
        loaded = load_checkpoint(storage, key, with_states=False)
        experiment, state = loaded.experiment, loaded.state
        program, trainer, moved = self._build(experiment)
        check_position(state, program, location_of(storage, key))
        trainer.restore(loaded.params, {}, stage=int(state["stage"]))
        return Opened(
            location=loaded.location,
            step=loaded.step,
            finished=bool(experiment.get("finished")),
            slug=str(experiment["slug"]),
            program=program,
            trainer=trainer,
            moved=moved,
        )

    def program(self, experiment: dict[str, Any]) -> Program:
        """The checkpoint's program, compiled once per file, sources, knobs and variant."""
        identity = json.dumps(
            [experiment.get(k) for k in ("file", "sources", "knobs", "variant")], sort_keys=True
        )
        if identity not in self._programs:
            self._programs[identity] = compile_recorded(experiment, self.file)
        return self._programs[identity]

    def _build(self, experiment: dict[str, Any]) -> tuple[Program, Trainer, list[str]]:
        from sexpgpu.run import lower_program

        identity = json.dumps(
            [experiment.get(k) for k in ("file", "sources", "knobs", "variant", "choices")],
            sort_keys=True,
        )
        if identity not in self._built:
            program = self.program(experiment)
            if program.run.name != experiment.get("run"):
                raise CheckpointError(
                    f"the checkpoint is of the run '{experiment.get('run')}', and "
                    f"{self.file or experiment['file']} defines '{program.run.name}'",
                    code=E_EVAL_FOREIGN,
                )
            recorded_states = {k: tuple(v) for k, v in experiment.get("states", {}).items()}
            try:
                moved = compare_for_resume(
                    experiment,
                    program,
                    devices=int(experiment.get("devices", 1)),
                    nodes=int(experiment.get("nodes", 1)),
                    state_names=recorded_states,
                )
            except SexpError as error:
                raise one_line(error) from None
            pinned, moved_lowering = self._pins(experiment)
            trainer = lower_program(
                program, device=self.device, pinned=pinned, lowering=self.lowering
            )
            moved += moved_lowering + _read_loads(program, trainer, experiment)
            self._built[identity] = (program, trainer, moved)
        return self._built[identity]

    def _pins(self, experiment: dict[str, Any]) -> tuple[dict[str, str] | None, list[str]]:
        """The choices to lower with, and the ``choice`` line when the lowering moved:
        the recorded choices under the recorded lowering; none under another one (its
        kernels are its own, chosen afresh for this machine)."""
        recorded = dict(experiment.get("choices", {}))
        ran_on = with_lowering(recorded)[LOWERING_CHOICE]
        if self.lowering is None or self.lowering == ran_on:
            return recorded, []
        return None, [f"choice {LOWERING_CHOICE} {ran_on} -> {self.lowering}"]


def _read_loads(program: Program, trainer: Trainer, experiment: dict[str, Any]) -> list[str]:
    """The ``:load`` files checked against the ones the checkpoint pinned (``E-LOAD-001``),
    and its frozen ``:load`` parameters read from them into ``trainer``, as a resume
    does; returns the ``load`` lines of files found at another path."""
    if not any(param.load is not None for param in program.params):
        return []
    from sexpgpu.checkpoint import compare_loads
    from sexpgpu.loading import Loads

    loads = Loads.of(program)
    loads.check()
    frozen = [p.path for p in program.params if p.load is not None and not p.trainable]
    try:
        moved = compare_loads(experiment, loads.identities())
    except SexpError as error:
        raise one_line(error) from None
    if frozen:
        trainer.set_params(loads.read(frozen))
    return moved


def one_line(error: SexpError) -> SexpError:
    """``error`` with its lines joined by ``; ``: evaluate says everything on one line."""
    lines = [line.strip() for line in error.message.splitlines() if line.strip()]
    return type(error)("; ".join(lines), code=error.code)
