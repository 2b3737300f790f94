"""The training loop: compile, check the checkpoint location, lower, train, checkpoint, stop.

Read it top to bottom: :func:`run` sets a run up and hands it to
:class:`Run`, whose :meth:`Run.train` is the step loop. A step takes a batch,
lets the trainer propose new parameters and states, checks the proposal when
the finite guard is on, and commits it; counters and the step number advance
only on commit. Checkpoints go to a :class:`~sexpgpu.checkpointer.Checkpointer`
(snapshot in the loop, write and report in the background, retention), and
what a person sees to a :class:`~sexpgpu.reporting.Reporter`.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sexpgpu.cpu_choices import pins_for
from sexpgpu.errors import (
    CheckpointError,
    PluginError,
    RunError,
    SexpError,
    StorageError,
    UsageError,
)
from sexpgpu.extension import (
    RankGroup,
)
from sexpgpu.graph import Program
from sexpgpu.kernels import with_lowering
from sexpgpu.log import get_logger
from sexpgpu.plugins import get_plugins
from sexpgpu.ranks import (
    SOLO,
    StopAgreement,
    Unwritten,
    check_batches,
    check_replicas,
    hand_over,
    join_group,
)
from sexpgpu.reporting import DEFAULT_LOG_EVERY, LogEvery, Reporter
from sexpgpu.schedule import lr_at
from sexpgpu.signals import StopWatch, interruption, process_watch
from sexpgpu.supplied import eval_runner, lower_program, open_data, optimizers_available

DEFAULT_METRICS_DIR = "./sexpgpu-runs"


@dataclass
class RunOptions:
    """What ``sexpgpu run`` was asked to do."""

    file: str
    sets: Mapping[str, str] = field(default_factory=dict)
    variant: str | None = None
    steps: int | None = None
    device: str = "cpu"
    metrics_dir: str = DEFAULT_METRICS_DIR
    metrics_sinks: tuple[str, ...] = ("jsonl",)
    checkpoint_dir: str | None = None
    resume: str | None = None
    fresh_choices: bool = False
    lowering: str | None = None
    """``--lowering``: the lowering by name (default: the device kind's; pinned on resume)."""
    threads: int | None = None
    """``--threads``: the CPU's intra-op thread count (pinned as ``cpu.threads``)."""
    choose: Mapping[str, str] = field(default_factory=dict)
    """``--choose``: a kernel per choice site or kind (``{"attention": "sdpa"}``)."""
    progress: bool = False
    keep_last: int | None = None
    """``--keep-last``: wins over the file's ``:keep-last``."""
    log_every: str = DEFAULT_LOG_EVERY
    """``--log-every``: how often a step line is logged off a terminal."""


@dataclass
class RunOutcome:
    """How a run ended: the exit code and the line to print (``None`` for a normal end)."""

    exit_code: int
    message: str | None
    step: int


def run(options: RunOptions) -> RunOutcome:
    """Run a `.sx` file as ``sexpgpu run`` does; signals are handled while it runs.

    Under the ``sexpgpu`` command the process's watch, installed at start-up and
    kept until exit, is used; called as a library, the run takes the signals
    itself and gives them back when it returns.
    """
    watch = process_watch()
    owned = watch is None
    if watch is None:
        watch = StopWatch()
    active = Run()
    try:
        try:
            if owned:
                watch.install()
                watch.interrupt_if_stopping()
            active.set_up(options, watch)
        except BaseException as error:
            if interruption(error) is None:
                raise
            # Nothing to save yet. The step is the one the run would start from:
            # 0 until the checkpoint it resumes from has been read.
            step = getattr(active, "step", 0)
            name, signum = watch.settle()
            return RunOutcome(128 + signum, f"interrupted by {name} at step {step}", step)
        return active.train()
    finally:
        watch.ended()  # the outcome is decided: no later signal changes it
        active.group.close()
        if owned:
            watch.uninstall()


def state_names_for(
    program: Program, stage: int, optimizers: Mapping[str, Any]
) -> dict[str, tuple[str, ...]]:
    """Each parameter's optimizer state names in ``stage`` (none for frozen ones)."""
    decl = program.stages[stage].optimizer
    info = optimizers.get(decl.name)
    if info is None:
        raise PluginError(f"no installed plugin supplies the optimizer '{decl.name}'")
    names = tuple(info.state_names(decl.options))
    return {p.path: (names if p.trainable else ()) for p in program.params}


def _stage_of(program: Program, step: int) -> tuple[int, int]:
    """(stage index, 1-based step within it) of the 1-based global ``step``."""
    start = 0
    for index, stage in enumerate(program.stages):
        if step <= start + stage.steps:
            return index, step - start
        start += stage.steps
    raise ValueError(f"step {step} is past the program's {program.steps} steps")


class Run:
    """A run that is set up and ready to train."""

    def __init__(self) -> None:
        self.log = get_logger("sexpgpu.run")
        self.already_finished: str | None = None
        """Set when the checkpoint resumed from is past the last step: nothing to do."""
        self.group: RankGroup = SOLO
        """This process's ranks: :data:`~sexpgpu.ranks.SOLO` unless a launcher started several."""

    # ------------------------------------------------------------------ setup

    def set_up(self, options: RunOptions, watch: StopWatch) -> None:
        """Compile, check the checkpoint location, read the checkpoint to resume,
        lower and open data and metrics. Raises a SexpError for anything wrong."""
        self.options = options
        self.watch = watch
        self.every = LogEvery.parse(options.log_every)
        # The ranks first: the device, who writes, and the counts a resume compares.
        self.group = join_group(options.device, get_plugins().available("sexpgpu_lowerings"))
        self.stops = StopAgreement(self.group, watch)
        self._open_location(options)
        program = self.program = self._compile(options)
        resumed = self.resumed = self._read_resume(options, program)

        self.optimizers = optimizers_available()
        state = resumed.state if resumed else None
        self._take_state(state or {})
        self.devices, self.nodes = self.group.size, self.group.nodes
        check_batches(program, self.group)

        moved: list[str] = []
        pinned = pins_for(None, fresh=False, threads=options.threads)
        if resumed:
            moved, pinned = self._compare_resumed(resumed)
            if self.step >= program.steps and not self.evals_pending:
                # A finished run started again changes nothing: no event, no status write.
                self.already_finished = (
                    f"finished: {self.resumed_from} is step {self.step} of {program.steps}; "
                    "nothing to do"
                )
                return

        self.trainer = lower_program(
            program,
            device=self.group.device,
            pinned=pinned,
            lowering=options.lowering,
            choose=options.choose,
        )
        warm_up = getattr(self.trainer, "warm_up", None)
        if warm_up is not None:  # a compiling lowering pays it before the first step
            warm_up()
        if self.group.size > 1:
            hand_over(self.trainer, self.group)
        moved += self._set_tensors(resumed)

        # Data: one loader per stage, opened when the stage starts.
        self.loader = None
        self.loader_stage = -1
        if self.step < program.steps:
            next_stage, _ = _stage_of(program, self.step + 1)
            self._open_stage_loader(next_stage)
            if state and next_stage == self.stage and state.get("loader") is not None:
                self.loader.restore(state["loader"])

        # From here on a signal stops the run at a step boundary instead of at once,
        # so the status file and the metrics stream always see how it ended.
        watch.interrupt_if_stopping()  # a signal whose exception was swallowed on the way
        watch.loop_started()
        self._open_outputs(resumed, moved)

    def _compile(self, options: RunOptions) -> Program:
        """The program, with its :load files' headers checked before anything is
        lowered or written; their identities (a local file's sha256) are read
        meanwhile, the tensors once lowered."""
        from sexpgpu.lang import compile_file
        from sexpgpu.loading import Loads

        self.log.info("compiling", file=options.file)
        program = compile_file(
            options.file, sets=dict(options.sets), variant=options.variant, steps=options.steps
        )
        self.loads = Loads.of(program)
        self.loads.check()
        self.loads.prefetch_identities()
        return program

    def _read_resume(self, options: RunOptions, program: Program) -> Any:
        """The checkpoint ``--resume`` names, read and verified; ``None`` to start fresh."""
        from sexpgpu import checkpoint as ckpt

        if not options.resume:
            return None
        found = ckpt.resolve_resume(options.resume, options.checkpoint_dir)
        if found is None:
            return None
        source_storage, key = found
        resumed = ckpt.load_for_resume(
            source_storage, key, program, latest=options.resume.strip() == "latest"
        )
        self.resumed_from = ckpt.location_of(source_storage, key)
        return resumed

    def _compare_resumed(self, resumed: Any) -> tuple[list[str], dict[str, str]]:
        """What moved since the checkpoint (refusing what may not), and the pins it sets."""
        from sexpgpu import checkpoint as ckpt

        moved = ckpt.compare_for_resume(
            resumed.experiment,
            self.program,
            devices=self.devices,
            nodes=self.nodes,
            state_names=state_names_for(self.program, self.stage, self.optimizers),
        )
        pinned = pins_for(
            with_lowering(resumed.experiment.get("choices", {})),
            fresh=self.options.fresh_choices,
            threads=self.options.threads,
        )
        return moved, pinned

    def _set_tensors(self, resumed: Any) -> list[str]:
        """Fill the lowered trainer: the checkpoint's tensors on a resume (returning
        the :load files and choices that moved), else fresh ones and the :load files."""
        from sexpgpu import checkpoint as ckpt

        if not resumed:
            self.trainer.init_params()
            self.trainer.set_params(self.loads.read())
            self.loaded = self.loads.identities()
            return []
        self.trainer.restore(resumed.params, resumed.states, stage=self.stage)
        # A checkpoint names its frozen :load parameters: read from their files again,
        # which must be the bytes the checkpoint's run read (E-LOAD-001).
        program = self.program
        frozen = [p.path for p in program.params if p.load is not None and not p.trainable]
        self.trainer.set_params(self.loads.read(frozen))
        self.loaded = self.loads.identities()
        moved = ckpt.compare_loads(resumed.experiment, self.loaded)
        old_choices = with_lowering(resumed.experiment.get("choices", {}))
        for site, name in sorted(self.trainer.choices.items()):
            if old_choices.get(site, name) != name:
                moved.append(f"choice {site} {old_choices[site]} -> {name}")
        return moved

    def _open_location(self, options: RunOptions) -> None:
        """Open the checkpoint location, or warn once that nothing will be saved."""
        from sexpgpu.storage import open_location

        # The checkpoint location is proved listable and writable before anything
        # else, so a run never finds out hours in that it cannot write.
        self.storage = None
        if options.checkpoint_dir:
            self.storage = open_location(options.checkpoint_dir)
            if self.group.is_writer:  # the other ranks only read (a checkpoint to resume)
                self.storage.check_writable()
            return
        if not self.group.is_writer:  # said once, by rank 0
            return
        self.log.warning(
            "no checkpoint location: nothing will be saved, and a signal or a crash loses the run",
            hint="--checkpoint-dir or SEXPGPU_CHECKPOINT_DIR",
        )

    def _take_state(self, state: Mapping[str, Any]) -> None:
        """Where the run is: a checkpoint's ``state.json``, or ``{}`` for a fresh start."""
        self.step = int(state.get("step", 0))
        self.stage = int(state.get("stage", 0))
        self.records = int(state.get("records", 0))
        self.evals_pending: list[str] = list(state.get("evals_pending", []))
        self.counters = {name: 0 for name in self.program.run.counters}
        self.counters.update({k: int(v) for k, v in state.get("counters", {}).items()})

    def _open_outputs(self, resumed: Any, moved: list[str]) -> None:
        """Metrics, the status file and the checkpointer; a resumed run reports into
        the same experiment."""
        from sexpgpu.checkpointer import Checkpointer
        from sexpgpu.metrics import MetricsStream, new_slug, open_sinks
        from sexpgpu.status import StatusFile, run_identity

        options, program = self.options, self.program
        self.slug = resumed.experiment["slug"] if resumed else new_slug(_stem(options.file))
        self.run_dir = os.path.join(options.metrics_dir, self.slug)
        self.checkpointer = None
        if not self.group.is_writer:  # rank 0 reports and writes for every rank
            self.metrics = MetricsStream([], experiment=self.slug)
            self.status = Unwritten()  # type: ignore[assignment]
            self.resumed_location = self.resumed_from if resumed else None
            return
        try:
            os.makedirs(self.run_dir, exist_ok=True)
        except OSError as exc:
            # a user's folder (a file in the way, no permission): one line, not a traceback
            raise RunError(
                f"cannot use {options.metrics_dir} as the metrics folder: {exc.strerror or exc}"
            ) from None
        self.metrics = MetricsStream(
            open_sinks(list(options.metrics_sinks), options.metrics_dir, self.slug),
            experiment=self.slug,
        )
        self.status = StatusFile(os.path.join(self.run_dir, "status.json"))
        self.resumed_location = resumed_from = self.resumed_from if resumed else None
        self.status.update(
            state="running",
            step=self.step,
            checkpoint=resumed_from,
            slug=self.slug,
            **run_identity(options.file, program, self.trainer.choices),
        )
        self.checkpointer = None
        if self.storage is not None:
            keep = options.keep_last if options.keep_last is not None else program.run.keep_last
            self.checkpointer = Checkpointer(
                self.storage,
                self.trainer,
                metrics=self.metrics,
                status=self.status,
                keep_last=keep,
                resumed_from=resumed_from,
                # a checkpoint owing passes is written again once they have run
                written_step=self.step if resumed and not self.evals_pending else None,
            )
        if resumed:
            self.metrics.annotation(
                self.step, "\n".join([f"resumed from {self.resumed_from}", *moved])
            )
        self.log.info(
            "run started" if not resumed else "run resumed",
            file=options.file,
            slug=self.slug,
            device=options.device,
            parameters=sum(_numel(p.type.shape) for p in program.params),
            steps=program.steps,
            step=self.step,
            choices=dict(self.trainer.choices),
            # a lowering that compiles its graphs before the first step says how long
            **_compile_time(self.trainer),
        )

    @property
    def last_checkpoint(self) -> str | None:
        """The newest checkpoint stored (or resumed from), as its location."""
        if self.checkpointer is not None:
            return self.checkpointer.last
        return self.resumed_location

    def _open_stage_loader(self, stage: int) -> None:
        decl = self.program.stages[stage].data
        self.loader_info, self.loader = open_data(decl, self.program.run.seed)
        self.loader_stage = stage
        if "tokens" in self.counters and self.loader_info.tokens_field is None:
            raise UsageError(
                f"{decl.pos}: the data source '{decl.source}' has no token field, "
                "so the counter 'tokens' cannot be kept; count records instead"
            )

    # ------------------------------------------------------------------ loop

    def train(self) -> RunOutcome:
        """The step loop, and how the run ends: finished, interrupted or failed."""
        if self.already_finished is not None:
            return RunOutcome(0, self.already_finished, self.step)
        program = self.program
        total = program.steps
        self.reporter = Reporter(
            total=total,
            step=self.step,
            every=self.every,
            terminal=self.options.progress,
            tokens=self.counters.get("tokens"),
        )
        # A lowering whose loss stays on its device until read (CUDA) has it read one
        # step late, once the next step is queued, so a step costs no host sync for
        # its metrics; anything said of a step (a pass, a checkpoint, a stop, an end)
        # reports that step's loss first, so the events keep their order.
        self.loss_late = bool(getattr(self.trainer, "reads_loss_late", False))
        self.unreported: tuple[int, Any, float] | None = None
        try:
            # the eval plugin is asked before the first step, so a conflict or a missing
            # plugin never surfaces hours in, at the first pass
            self.evaluator = eval_runner() if program.evals else None
            if self.evals_pending:  # passes a signal stopped before they reported
                self._evaluate(self.step, self.evals_pending)
            if self.stops.stopping():
                return self._interrupted()
            while self.step < total:
                step = self.step + 1
                stage, step_in_stage = _stage_of(program, step)
                if stage != self.loader_stage:
                    self._open_stage_loader(stage)
                batch = self.loader.next_batch()
                lr = lr_at(
                    program.stages[stage].optimizer, step_in_stage, program.stages[stage].steps
                )
                proposal = self.trainer.propose(batch, stage=stage, step=step, lr=lr)
                self._report_unreported()  # the step before: this one is queued behind it
                if program.run.guard_finite:
                    self._guard(proposal)
                self.trainer.commit(proposal)
                self.step, self.stage = step, stage
                self._count(batch)
                self.unreported = (step, proposal, lr)
                if not self.loss_late:
                    self._report_unreported()
                self._maybe_evaluate(step)
                # A last step whose pass a signal stopped is no finished run: the
                # pass stays pending in its checkpoint and the resume runs it.
                ended = step == total and not self.evals_pending
                every = program.run.checkpoint_every
                if self.checkpointer is not None and (
                    step == total or (every and step % every == 0)
                ):
                    self._checkpoint(finished=ended)
                if not ended and self.stops.stopping():
                    return self._interrupted()
            if self.checkpointer is not None and self.step == total:
                # a resume that ran the last step's pending pass: its checkpoint again,
                # finished and owing nothing (a step already written is not written again)
                self._checkpoint(finished=True)
            self._report_unreported()
            self._wait_for_checkpoint()
            # every rank holds the same bytes (E-DP-003), and waits here for rank 0's checkpoint
            check_replicas(self.group, self.trainer, self.step)
            self.metrics.done(self.step)
            self._finish("finished")
            return RunOutcome(0, None, self.step)
        except SexpError as error:
            self._report_unreported(failing=True)
            line = error.render()
            # An error in a step is named by that step; a checkpoint write that
            # failed names its own step.
            if not isinstance(error, (CheckpointError, StorageError)):
                line = f"step {self.step + 1}: {line}"
            return self._failed(line, error)
        except Exception as error:  # a bug or an op failing at run time: one line, traceback kept
            self._report_unreported(failing=True)
            self.reporter.close()
            line = f"{type(error).__name__}: {error}".splitlines()[0]
            with open(os.path.join(self.run_dir, "traceback.txt"), "w") as f:
                traceback.print_exc(file=f)
            return self._failed(
                f"step {self.step + 1}: {line} (traceback in {self.run_dir}/traceback.txt)", error
            )

    def _guard(self, proposal: Any) -> None:
        """The finite guard: refuse a proposal with a value that is not finite. The
        ranks' verdicts are agreed (one collective), so every rank stops or none."""
        bad = self.trainer.find_non_finite(proposal)
        if self.group.size > 1 and self.group.max(int(bad is not None)) and bad is None:
            raise RunError(
                "another rank's proposed step has values that are not finite; nothing was committed"
            )
        if bad is not None:
            kind, name, count = bad
            what = (
                f"proposed parameter of {name}" if kind == "parameter" else f"proposed state {name}"
            )
            raise RunError(
                f"the {what} has {count} values that are not finite; nothing was committed"
            )

    def _report_unreported(self, *, failing: bool = False) -> None:
        """Report the step whose loss was left on the device (see ``train``). As a run
        fails, the device may be what failed: its loss is then left out."""
        if self.unreported is None:
            return
        step, proposal, lr = self.unreported
        self.unreported = None
        try:
            loss = float(proposal.loss)
        except Exception:
            if not failing:
                raise
            return
        self._report_step(step, loss, lr)

    def _report_step(self, step: int, loss: float, lr: float) -> None:
        self.metrics.point(step, "loss", loss)
        self.metrics.point(step, "lr", lr)
        for name, value in self.counters.items():
            self.metrics.point(step, name, value)
        self.reporter.step(step, loss, lr, self.counters.get("tokens"))
        self.status.progress(step)

    def _count(self, batch: Mapping[str, Any]) -> None:
        first = next(iter(batch.values()))
        records = int(first.shape[0]) if getattr(first, "shape", ()) else 1
        self.records += records
        if "records" in self.counters:
            self.counters["records"] += records
        if "tokens" in self.counters:
            self.counters["tokens"] += int(batch[self.loader_info.tokens_field].size)

    def _maybe_evaluate(self, step: int) -> None:
        due = [p.name for p in self.program.evals if p.every and step % p.every == 0]
        if due:
            self._evaluate(step, due)

    def _evaluate(self, step: int, names: list[str]) -> None:
        """Ask the eval plugin to run the named passes, as storage is asked to write;
        one a signal stops reports nothing and stays in ``evals_pending``."""
        self._report_unreported()
        self.evals_pending = list(names)
        assert self.evaluator is not None  # train() asked for it: the program has passes
        for eval_pass in [p for p in self.program.evals if p.name in names]:
            numbers = self.evaluator.run_pass(
                eval_pass,
                self.trainer,
                seed=self.program.run.seed,
                open_data=lambda decl, seed: open_data(decl, seed)[1],
                stopping=self.stops.pass_may_stop,
            )
            if numbers is None:
                return
            for name, value in numbers.items():
                self.metrics.point(step, f"{eval_pass.name}/{name}", value)
            self.reporter.evaluated(step, eval_pass.name, numbers)
            self.evals_pending.remove(eval_pass.name)

    # ------------------------------------------------------------ checkpoints

    def _checkpoint(self, *, finished: bool) -> None:
        """Checkpoint the current step (written and reported in the background)."""
        from sexpgpu import checkpoint as ckpt

        self._report_unreported()

        def state() -> dict[str, Any]:
            return ckpt.state_record(
                step=self.step,
                stage=self.stage,
                records=self.records,
                counters=self.counters,
                loader=self.loader.position() if self.loader is not None else None,
                seed=self.program.run.seed,
                evals_pending=self.evals_pending,
            )

        def experiment() -> dict[str, Any]:
            return ckpt.experiment_record(
                self.program,
                choices=self.trainer.choices,
                slug=self.slug,
                devices=self.devices,
                nodes=self.nodes,
                finished=finished,
                state_names=state_names_for(self.program, self.stage, self.optimizers),
                loaded=self.loaded,
            )

        assert self.checkpointer is not None
        self.checkpointer.save(self.step, state=state, experiment=experiment, wait=finished)

    def _wait_for_checkpoint(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait()

    # ---------------------------------------------------------------- endings

    def _interrupted(self) -> RunOutcome:
        # The spec's order: the stop is named and reported, then its checkpoint written.
        self._report_unreported()
        name, signum = self.stops.settle()
        self.metrics.annotation(self.step, f"interrupted by {name} at step {self.step}")
        if self.checkpointer is not None and self.step > 0:
            self._checkpoint(finished=False)
            self._wait_for_checkpoint()
        check_replicas(self.group, self.trainer, self.step)
        self._finish("interrupted")
        return RunOutcome(128 + signum, f"interrupted by {name} at step {self.step}", self.step)

    def _failed(self, line: str, error: BaseException) -> RunOutcome:
        try:
            self._wait_for_checkpoint()
        except SexpError as write_error:
            self.log.error("checkpoint failed", error=str(write_error))
        self.metrics.annotation(self.step, f"failed: {line}")
        self._finish("failed", error=line)
        return RunOutcome(1, line, self.step)

    def _finish(self, state: str, error: str | None = None) -> None:
        """Write the last status, drain the metrics, stop the writer, log the summary."""
        self.reporter.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
        fields: dict[str, Any] = {
            "state": state,
            "step": self.step,
            "checkpoint": self.last_checkpoint,
        }
        if error is not None:
            fields["error"] = error
        self.status.update(**fields)
        undelivered = self.metrics.close(timeout=30.0)
        summary: dict[str, Any] = {
            "checkpoint": self.last_checkpoint,
            "metrics": os.path.join(self.run_dir, "events.jsonl"),
            "status": os.path.join(self.run_dir, "status.json"),
        }
        if undelivered:
            # A metrics folder that filled up or went away mid-run: said at the end too.
            summary["undelivered_events"] = undelivered
            summary["undelivered_by_sink"] = dict(self.metrics.undelivered_by_sink)
        self.watch.ended()  # from `run <state>` on, no signal changes the outcome
        self.reporter.summary(state, self.step, **summary)


def _compile_time(trainer: Any) -> dict[str, float]:
    seconds = getattr(trainer, "compile_seconds", None)
    return {} if seconds is None else {"compile_seconds": seconds}


def _stem(path: str) -> str:
    base = os.path.basename(path)
    return base[:-3] if base.endswith(".sx") else base


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total
