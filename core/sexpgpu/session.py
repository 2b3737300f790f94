"""The one way to open work, to a ready trainer: :meth:`Session.start` compiles the
selection, reads and verifies the checkpoint it continues and settles the choices, then
lowers and fills the trainer (the checkpoint's tensors or fresh ones, and the ``:load``
files, which must be the bytes the checkpoint's run read: ``E-LOAD-001``).
:class:`CheckpointOpener` reads a checkpoint to evaluate it, as a resume does, less.
Everything a plugin supplies comes from the catalog handed in. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from sexpgpu.choices import LOWERING_CHOICE, Choices
from sexpgpu.errors import CheckpointError, PluginError, SexpError, SourceError
from sexpgpu.extension import DataLoader, Evaluator, Supplies, Trainer, with_defaults
from sexpgpu.opening import Selection, Target, recorded_choices

__all__ = [  # Selection, Target and recorded_choices are the opener's, used through here too
    "CheckpointOpener", "Lowered", "Opened", "Selection", "Session", "Target",
    "evaluator", "lower", "open_loader", "recorded_choices", "state_names_for",
]  # fmt: skip

if TYPE_CHECKING:
    from sexpgpu.catalog import Catalog
    from sexpgpu.checkpoint import Loaded
    from sexpgpu.checkpoint.loads import Loads
    from sexpgpu.extension import DataSourceInfo, OpenedSource, RankGroup, Storage
    from sexpgpu.lang.ir import DataDecl, Program


E_FOREIGN_RUN = "E-EVAL-002"
"""A checkpoint opened with a file whose run is not the checkpoint's."""

_PROGRAM_KEYS = ("file", "sources", "knobs", "variant")  # what fixes a checkpoint's program


@dataclass
class Lowered:
    """A lowered program: its trainer, the lowering's name, and the choices to record
    (the trainer's own and ``lowering``)."""

    trainer: Trainer
    lowering: str
    made: dict[str, str]


def lower(program: Program, catalog: Catalog, *, device: str, choices: Choices) -> Lowered:
    """Lower ``program`` for ``device``: the lowering ``choices`` name (``--lowering``,
    a resume's pin), else the device kind's default; every available kernel,
    optimizer and plugin op handed in, and ``choices`` taken."""
    from sexpgpu.kernels import choose_lowering, device_kind
    from sexpgpu.plugin_supplies import defaults_of

    lowerings = catalog.lowerings()
    info = choose_lowering(lowerings, device=device, choices=choices)
    if info is None:
        # the kind's default; with none available, the one lowering that serves it
        kind = device_kind(device)
        defaulted = any(kind in defaults_of(item) for item in lowerings)
        info = catalog.require(
            "sexpgpu_lowerings",
            f"the device '{device}'",
            lambda item: kind in (defaults_of(item) if defaulted else item.devices),
        )
    supplies = Supplies(
        kernels=catalog.kernels(), optimizers=catalog.optimizers(), ops=catalog.plugin_ops()
    )
    lowered = info.factory().lower(program, device=device, supplies=supplies, choices=choices)
    trainer = with_defaults(lowered, Trainer)
    _check_trainer(trainer, info.name)
    made = {**trainer.choices, LOWERING_CHOICE: info.name}
    return Lowered(trainer, info.name, made)


def _check_trainer(trainer: Any, lowering: str) -> None:
    """Refuse, before any step, a trainer that lacks part of the Trainer protocol."""
    if isinstance(trainer, Trainer):
        return
    missing = [name for name in _TRAINER_MEMBERS if not hasattr(trainer, name)]
    raise PluginError(
        f"the {lowering} lowering built a trainer without {', '.join(missing)}; a trainer "
        "follows sexpgpu.extension.Trainer (subclass it for the optional parts' defaults)"
    )


_TRAINER_MEMBERS = sorted(
    name for name in {*vars(Trainer), *Trainer.__annotations__} if not name.startswith("_")
)


def state_names_for(program: Program, stage: int, catalog: Catalog) -> dict[str, tuple[str, ...]]:
    """Each parameter's optimizer state names in ``stage`` (none for frozen ones)."""
    decl = program.stages[stage].optimizer
    info = catalog.optimizers()[decl.name]  # the compiler found it in this catalog
    names = tuple(info.state_names(decl.options))
    return {p.path: (names if p.trainable else ()) for p in program.params}


def open_loader(catalog: Catalog, decl: DataDecl, seed: int) -> tuple[DataSourceInfo, DataLoader]:
    """The data source a ``defdata`` names, and a loader opened on it from ``seed``; a
    source's complaint (a file gone since the program compiled, or never checked, as
    ``evaluate`` does not) points at the ``defdata``."""
    info = catalog.data_source(decl.source)
    try:
        loader = info.factory(decl.options, decl.seq, decl.batch, seed)
        return info, with_defaults(loader, DataLoader)
    except SexpError as exc:
        if exc.pos is not None:
            raise
        raise SourceError(exc.message, code=exc.code, pos=decl.pos) from None


def evaluator(catalog: Catalog) -> Evaluator:
    """The eval-pass runner an available plugin supplies, given every available eval
    metric: what a run calls at a pass's steps, and ``sexpgpu evaluate`` too."""
    return catalog.evaluator().factory(catalog.eval_metrics())


class Session:
    """A program opened for a run: compiled, its checkpoint (if it resumes) read and
    verified, its choices settled; then lowered (:meth:`lower`) and filled
    (:meth:`fill`). A run lowers only when there is something to do."""

    def __init__(self, catalog: Catalog, program: Program, loads: Loads) -> None:
        self.catalog = catalog
        self.program = program
        self.loads = loads
        self.checkpoint: Loaded | None = None
        """The checkpoint continued, read and verified; ``None`` on a fresh start."""
        self.location: str | None = None
        """Where :attr:`checkpoint` was read from."""
        self.choices = Choices()
        self.moved: list[str] = []
        """What moved since the checkpoint, one ``resumed from`` line each."""
        self.lowered: Lowered | None = None
        self.source: OpenedSource | None = None
        """The source the program was opened from, when it is not the file named."""
        self.pinned_source = False
        """Whether the choices pinned are the source's (a fresh start that takes them)."""

    @classmethod
    def start(
        cls,
        catalog: Catalog,
        selection: Selection,
        target: Target,
        *,
        resume: str | None = None,
        checkpoint_dir: str | None = None,
        devices: int = 1,
        nodes: int = 1,
    ) -> Session:
        """Compile ``selection`` (its ``:load`` headers checked before anything is
        lowered or written; their identities read meanwhile), read the checkpoint
        ``resume`` names (``latest``: the newest under ``checkpoint_dir``, or a fresh
        start), check that the program may continue it on ``devices`` devices of
        ``nodes`` nodes, and settle the choices."""
        from sexpgpu.checkpoint.loads import Loads

        program = selection.compile(catalog)
        loads = Loads.of(program, catalog.open_location, root=selection.root)
        loads.check()
        loads.prefetch_identities()
        session = cls(catalog, program, loads)
        session.source = source = selection.source
        session._resume(resume, checkpoint_dir)
        recorded = None
        if session.checkpoint is not None:
            from sexpgpu import checkpoint as ckpt

            experiment = session.checkpoint.experiment
            session.moved = ckpt.compare_for_resume(
                experiment,
                program,
                devices=devices,
                nodes=nodes,
                state_names=state_names_for(program, session.stage, catalog),
                root=selection.root,
            )
            recorded = recorded_choices(experiment, catalog)
        if recorded is None and source is not None and source.choices is not None:
            recorded = dict(source.choices)
            session.pinned_source = not target.fresh
        session.choices = target.choices(program, recorded)
        return session

    def _resume(self, resume: str | None, checkpoint_dir: str | None) -> None:
        from sexpgpu import checkpoint as ckpt

        if not resume:
            return
        found = ckpt.resolve_resume(resume, checkpoint_dir, self.catalog.open_location)
        if found is None:
            return
        storage, key = found
        self.checkpoint = ckpt.load_for_resume(
            storage, key, self.program, latest=resume.strip() == "latest"
        )
        self.location = ckpt.location_of(storage, key)

    @property
    def root(self) -> str | None:
        """The folder of the source the program was opened from (a checkpoint names its
        files by their paths there); ``None``: a `.sx` file."""
        return None if self.source is None else self.source.root

    @property
    def state(self) -> Mapping[str, Any]:
        """The checkpoint's ``state.json``; ``{}`` on a fresh start."""
        return self.checkpoint.state if self.checkpoint is not None else {}

    @property
    def stage(self) -> int:
        """The stage the run is in."""
        return int(self.state.get("stage", 0))

    def lower(self, device: str) -> Trainer:
        """Lower the program for ``device`` with the settled choices (a source's, taken
        on its terms: :meth:`OpenedSource.lowered`)."""
        lowering = partial(lower, self.program, self.catalog, device=device, choices=self.choices)
        source = self.source
        self.lowered = (
            source.lowered(lowering, fresh=not self.pinned_source) if source else lowering()
        )
        return self.lowered.trainer

    def use_group(self, group: RankGroup) -> None:
        """Hand the lowered trainer the ranks of a run on several devices; a trainer
        for one device only is refused before any step."""
        assert self.lowered is not None, "lower() first"
        try:
            self.lowered.trainer.use_group(group)
            self.lowered.made.update(self.lowered.trainer.choices)  # what it chose for them
        except NotImplementedError:
            raise PluginError(
                f"the lowering {self.lowered.lowering} cannot train on several devices; "
                "run it on one"
            ) from None

    @property
    def loaded(self) -> dict[str, dict[str, Any]]:
        """Each ``:load`` parameter's file identity, as a checkpoint pins it."""
        return self.loads.identities()

    @property
    def made(self) -> dict[str, str]:
        """The choices the run records (after :meth:`lower`)."""
        assert self.lowered is not None, "lower() first"
        return self.lowered.made

    def fill(self) -> list[str]:
        """Fill the lowered trainer: the checkpoint's tensors on a resume, else fresh
        ones, then the ``:load`` files. Returns what moved since the checkpoint (or a
        bundle's choices): each ``:load`` file at another path, each choice made otherwise."""
        from sexpgpu import checkpoint as ckpt

        assert self.lowered is not None, "lower() first"
        trainer = self.lowered.trainer
        if self.checkpoint is None:
            trainer.init_params()
            trainer.set_params(self.loads.read())
            # a file's hash reads the arrays handed over: one the optimizer updates in
            # place waits for it; a frozen teacher's goes on until a checkpoint pins it
            if any(p.trainable for p in self.loads.params):
                self.loads.identities()
            moved = self.choices.moved(self.made)  # a source's choices, chosen afresh
            whose = self.source.called if self.source is not None else "the recorded"
            said = f"chose afresh, not {whose} choices"
            return [said, *moved] if moved else []
        trainer.restore(self.checkpoint.params, self.checkpoint.states, stage=self.stage)
        # A checkpoint names its frozen :load parameters: read from their files again,
        # which must be the bytes the checkpoint's run read (E-LOAD-001).
        frozen = [p.path for p in self.program.params if p.load is not None and not p.trainable]
        trainer.set_params(self.loads.read(frozen))
        moved = ckpt.compare_loads(self.checkpoint.experiment, self.loaded)
        return moved + self.choices.moved(self.made)


@dataclass
class Opened:
    """A checkpoint opened to evaluate: its compiled program, and a trainer holding
    its parameters."""

    location: str
    step: int
    finished: bool
    slug: str
    program: Program
    trainer: Trainer
    moved: list[str]


class CheckpointOpener:
    """Opens checkpoints to evaluate them, as a resume reads them, less: never the states
    or the loader (docs/evaluation.md). A program and its lowering are built once per
    identity (sources, knobs, variant, choices): a follower reads many. Another lowering
    (``lowering``) chooses its kernels afresh; nothing is written back."""

    def __init__(
        self, catalog: Catalog, *, device: str, file: str | None, lowering: str | None = None
    ) -> None:
        self.catalog = catalog
        self.device = device
        self.file = file
        self.lowering = lowering
        self._built: dict[str, tuple[Program, Trainer, list[str]]] = {}
        self._programs: dict[str, Program] = {}

    def locate(self, location: str) -> tuple[Storage, str]:
        """A checkpoint named by its location (``/tmp/run/step-00000004``,
        ``s3://bucket/run/latest``) as (storage of its parent, key)."""
        from sexpgpu.checkpoint import open_checkpoint

        return open_checkpoint(location, self.catalog.open_location)

    def open(self, storage: Storage, key: str) -> Opened:
        """Read and verify the checkpoint at ``key``; raises a :class:`SexpError`."""
        from sexpgpu.checkpoint import check_position, load_checkpoint, location_of

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

    def program(self, experiment: Mapping[str, Any]) -> Program:
        """The checkpoint's program, compiled once per file, sources, knobs and variant."""
        identity = json.dumps([experiment.get(k) for k in _PROGRAM_KEYS], sort_keys=True)
        if identity not in self._programs:
            selection = Selection.recorded(experiment, self.file)
            # an evaluator reads only its passes' data, opened when a pass runs
            self._programs[identity] = selection.compile(self.catalog, check_files=False)
        return self._programs[identity]

    def _build(self, experiment: Mapping[str, Any]) -> tuple[Program, Trainer, list[str]]:
        from sexpgpu.checkpoint import compare_for_resume

        keys = (*_PROGRAM_KEYS, "choices")
        identity = json.dumps([experiment.get(k) for k in keys], sort_keys=True)
        if identity not in self._built:
            program = self.program(experiment)
            if program.run.name != experiment.get("run"):
                raise CheckpointError(
                    f"the checkpoint is of the run '{experiment.get('run')}', and "
                    f"{self.file or experiment['file']} defines '{program.run.name}'",
                    code=E_FOREIGN_RUN,
                )
            recorded_states = {k: tuple(v) for k, v in experiment.get("states", {}).items()}
            moved = compare_for_resume(
                experiment,
                program,
                devices=int(experiment.get("devices", 1)),
                nodes=int(experiment.get("nodes", 1)),
                state_names=recorded_states,
            )
            choices, moved_lowering = self._choices(experiment)
            trainer = lower(program, self.catalog, device=self.device, choices=choices).trainer
            moved += moved_lowering + self._read_loads(program, trainer, experiment)
            self._built[identity] = (program, trainer, moved)
        return self._built[identity]

    def _choices(self, experiment: Mapping[str, Any]) -> tuple[Choices, list[str]]:
        """The recorded choices under the recorded lowering; none, and the line saying
        it moved, under another (its kernels are its own)."""
        recorded = recorded_choices(experiment, self.catalog)
        ran_on = recorded.get(LOWERING_CHOICE, "-")
        if self.lowering is None or self.lowering == ran_on:
            return Choices(recorded=recorded), []
        chosen = Choices.make(
            requested={LOWERING_CHOICE: self.lowering},
            asked={LOWERING_CHOICE: f"--lowering {self.lowering}"},
        )
        return chosen, [f"choice {LOWERING_CHOICE} {ran_on} -> {self.lowering}"]

    def _read_loads(
        self, program: Program, trainer: Trainer, experiment: Mapping[str, Any]
    ) -> list[str]:
        """The ``:load`` files checked against the checkpoint's (``E-LOAD-001``) and its
        frozen ones read into ``trainer``, as a resume does; the lines of moved files."""
        if not any(param.load is not None for param in program.params):
            return []
        from sexpgpu.checkpoint import compare_loads
        from sexpgpu.checkpoint.loads import Loads

        loads = Loads.of(program, self.catalog.open_location)
        loads.check()
        frozen = [p.path for p in program.params if p.load is not None and not p.trainable]
        if frozen:  # first: a local file's one pass reads them and hashes it
            trainer.set_params(loads.read(frozen))
        return compare_loads(experiment, loads.identities())
