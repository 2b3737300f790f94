"""The training loop: open the work, train step by step, checkpoint, stop.

Read it top to bottom: :func:`run` opens a run (:meth:`Run.set_up`, through a
:class:`~sexpgpu.session.Session`) and trains it (:meth:`Run.train`). A step takes a
batch, lets the trainer propose new parameters and states, checks the proposal when
the finite guard is on, and commits it; counters and the step advance only on commit.
Checkpoints go to a :class:`~sexpgpu.checkpoint.checkpointer.Checkpointer` (snapshot
here, written in the background); what a person sees, to the :class:`Reporter`.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sexpgpu.batches import StageBatches, open_batches
from sexpgpu.errors import CheckpointError, RunError, SexpError, StorageError
from sexpgpu.extension import Evaluator, RankGroup, Trainer
from sexpgpu.lang.schedule import lr_at
from sexpgpu.log import get_logger
from sexpgpu.opening import Selection, Target, open_request
from sexpgpu.outputs import Outputs, Quiet, Reporter
from sexpgpu.ranks import SOLO, StopAgreement, check_batches, check_replicas, join_group
from sexpgpu.session import Session, evaluator
from sexpgpu.signals import StopWatch, interruption, process_watch
from sexpgpu.state import RunState

if TYPE_CHECKING:
    from sexpgpu.catalog import Catalog
    from sexpgpu.lang.ir import Program
    from sexpgpu.metrics import MetricsStream

DEFAULT_METRICS_DIR = "./sexpgpu-runs"


@dataclass
class RunOptions:
    """What ``sexpgpu run`` was asked to do."""

    selection: Selection
    target: Target = field(default_factory=Target)
    metrics_dir: str = DEFAULT_METRICS_DIR
    metrics_sinks: tuple[str, ...] = ()  #: by name (``--metrics-sink``)
    checkpoint_dir: str | None = None
    resume: str | None = None
    keep_last: int | None = None  #: ``--keep-last``: wins over the file's ``:keep-last``
    metrics_wait: float = 30.0  #: seconds the end of the run waits for its metrics sinks
    #: makes the run's :class:`Reporter` from (total steps, first step, tokens so far)
    reporter: Callable[[int, int, int | None], Reporter] = lambda total, step, tokens: Quiet()


@dataclass
class RunOutcome:
    """How a run ended: the exit code and the line to print (``None`` for a normal end)."""

    exit_code: int
    message: str | None
    step: int
    code: str | None = None
    """The code of the error that ended it (``E-DP-003``), for a caller to compare."""


def run(options: RunOptions, catalog: Catalog) -> RunOutcome:
    """Run a `.sx` file as ``sexpgpu run`` does, with what ``catalog`` supplies; signals
    are handled while it runs. Under the ``sexpgpu`` command the process's watch is
    used; called as a library, the run takes the signals itself and gives them back."""
    watch = process_watch()
    owned = watch is None
    watch = watch or StopWatch()
    active = Run(catalog)
    try:
        try:
            if owned:
                watch.install()
                watch.interrupt_if_stopping()
            active.set_up(options, watch)
        except BaseException as error:
            if interruption(error) is None:
                raise
            # Nothing to save yet: the step is 0 until a checkpoint has been read.
            name, signum = watch.settle()
            step = active.step
            return RunOutcome(128 + signum, f"interrupted by {name} at step {step}", step)
        return active.train()
    finally:
        watch.ended()  # the outcome is decided: no later signal changes it
        active.group.close()
        if owned:
            watch.uninstall()


class Run:
    """A run that is set up and ready to train."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.log = get_logger("sexpgpu.run")
        self.already_finished: str | None = None  # resumed past the last step: nothing to do
        self.group: RankGroup = SOLO  # unless a launcher started several ranks
        self.state = RunState()  # the last committed step's: what a checkpoint records
        self.options: RunOptions | None = None
        self.watch: StopWatch | None = None
        self.stops: StopAgreement | None = None
        self.session: Session | None = None
        self.program: Program | None = None
        self.trainer: Trainer | None = None
        self.batches: StageBatches | None = None
        self.outputs: Outputs | None = None
        self.metrics: MetricsStream | None = None
        self.status: Any = None
        self.reporter: Reporter = Quiet()
        self.evaluator: Evaluator | None = None
        self.unreported: tuple[int, Any, float] | None = None  # its loss still on the device
        self.failing_as: str | None = None  # what names a failure that is no step's (a pass)

    @property
    def step(self) -> int:
        return self.state.step

    def set_up(self, options: RunOptions, watch: StopWatch) -> None:
        """Open the work (compile, check the checkpoint location, read the checkpoint
        to resume, lower) and the data and metrics. Raises a SexpError for anything wrong."""
        from sexpgpu.outputs import open_location

        self.options, self.watch = options, watch
        # The ranks first: the device, who writes, and the counts a resume compares.
        self.group = join_group(options.target.device, self.catalog.lowerings())
        self.stops = StopAgreement(self.group, watch)
        storage = open_location(self.catalog, options.checkpoint_dir, self.group, self.log)
        selection = open_request(self.catalog, options.selection, options.target,
                                 resume=options.resume, checkpoint_dir=options.checkpoint_dir)  # fmt: skip
        self.log.info("compiling", file=selection.file)
        session = self.session = Session.start(
            self.catalog,
            selection,
            options.target,
            resume=options.resume,
            checkpoint_dir=options.checkpoint_dir,
            devices=self.group.size,
            nodes=self.group.nodes,
        )
        program = self.program = session.program
        self.state = RunState.of(session.state, program.run.counters)
        check_batches(program, self.group)
        if session.checkpoint and self.step >= program.steps and not self.state.evals_pending:
            # A finished run started again changes nothing: no event, no status write.
            self.already_finished = (
                f"finished: {session.location} is step {self.step} of {program.steps}; "
                "nothing to do"
            )
            return
        self.trainer = session.lower(self.group.device)
        if self.group.size > 1:  # first: a rank compiles for its own part of the work
            session.use_group(self.group)
        compile_seconds = self.trainer.warm_up()  # a compiling lowering pays it now
        moved = session.moved + session.fill()
        # Data: the batches of the stage the next step is in, opened as it starts.
        self.batches = StageBatches(
            self.catalog, program, self.trainer, self.group, self.stops.pass_may_stop
        )
        if self.step < program.steps:
            next_stage, _ = program.stage_of(self.step + 1)
            same = next_stage == self.state.stage
            self.batches.start(next_stage, self.state.loader if same else None)
        # From here on a signal stops the run at a step boundary instead of at once,
        # so the status file and the metrics stream always see how it ended.
        watch.interrupt_if_stopping()  # a signal whose exception was swallowed on the way
        watch.loop_started()
        self.outputs = Outputs.open(
            options=options, session=session, state=self.state, group=self.group,
            storage=storage, compile_seconds=compile_seconds, moved=moved, log=self.log,
        )  # fmt: skip
        self.metrics, self.status = self.outputs.metrics, self.outputs.status
        self.reporter = options.reporter(
            program.steps, self.step, self.state.counters.get("tokens")
        )

    def train(self) -> RunOutcome:
        """The step loop, and how the run ends: finished, interrupted or failed."""
        if self.already_finished is not None:
            return RunOutcome(0, self.already_finished, self.step)
        program, total = self.program, self.program.steps
        # A trainer whose loss stays on its device until read (CUDA) has it read one
        # step late, once the next step is queued, so a step costs no host sync for
        # its metrics; anything said of a step (a pass, a checkpoint, a stop, an end)
        # reports that step's loss first, so the events keep their order.
        try:
            # the eval plugin is asked before the first step, so a conflict or a missing
            # plugin never surfaces hours in, at the first pass
            self.evaluator = evaluator(self.catalog) if program.evals else None
            if self.state.evals_pending:  # passes a signal stopped before they reported
                self._evaluate(self.step, self.state.evals_pending)
            if self.stops.stopping():
                return self._interrupted()
            while self.step < total:
                step = self.step + 1
                stage, step_in_stage = program.stage_of(step)
                decl = program.stages[stage]
                batch = self.batches.take(step, stage)
                if batch is None:  # a signal abandoned its generation: nothing was counted
                    return self._interrupted(generating=True)
                lr = lr_at(decl.optimizer, step_in_stage, decl.steps)
                proposal = self.trainer.propose(batch, stage=stage, step=step, lr=lr)
                self._report_unreported()  # the step before: this one is queued behind it
                if program.run.guard_finite:
                    self._guard(proposal)
                self.trainer.commit(proposal)
                added = self.batches.counted(batch, self.state.counters)
                self.state = self.state.stepped(step, stage, added, self.batches.position())
                self.unreported = (step, proposal, lr)
                if not self.trainer.reads_loss_late:
                    self._report_unreported()
                self._maybe_evaluate(step)
                # A last step whose pass a signal stopped is no finished run: the
                # pass stays pending in its checkpoint and the resume runs it.
                ended = step == total and not self.state.evals_pending
                every = program.run.checkpoint_every
                if step == total or (every and step % every == 0):
                    self._checkpoint(finished=ended)
                if not ended and self.stops.stopping():
                    return self._interrupted()
            if self.step == total:
                # a resume that ran the last step's pending pass: its checkpoint again,
                # finished and owing nothing (a step already written is not written again)
                self._checkpoint(finished=True)
            self._report_unreported()
            self.outputs.wait_for_checkpoint()
            # every rank holds the same bytes (E-DP-003), and waits here for rank 0's checkpoint
            check_replicas(self.group, self.trainer, self.step)
            self.metrics.done(self.step)
            self._finish("finished")
            return RunOutcome(0, None, self.step)
        except SexpError as error:
            self._report_unreported(failing=True)
            # An error in a step is named by that step; a checkpoint that could not
            # be taken or written, by its own step.
            own = self.step if isinstance(error, (CheckpointError, StorageError)) else None
            at = self.failing_as or f"step {error.step or own or self.step + 1}"
            return self._failed(f"{at}: {error.render()}", error.code)
        except Exception as error:  # a bug or an op failing at run time: one line, traceback kept
            self._report_unreported(failing=True)
            self.reporter.close()
            line = f"{type(error).__name__}: {error}".splitlines()[0]
            name = "traceback.txt" if self.group.is_writer else f"traceback-{self.group.rank}.txt"
            os.makedirs(self.outputs.run_dir, exist_ok=True)
            with open(where := os.path.join(self.outputs.run_dir, name), "w") as f:
                traceback.print_exc(file=f)
            at = self.failing_as or f"step {self.step + 1}"
            return self._failed(f"{at}: {line} (traceback in {where})")

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
            what = f"parameter of {name}" if kind == "parameter" else f"state {name}"
            raise RunError(
                f"the proposed {what} has {count} values that are not finite; nothing was committed"
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
        self.metrics.point(step, "loss", loss)
        self.metrics.point(step, "lr", lr)
        for name, value in self.state.counters.items():
            self.metrics.point(step, name, value)
        self.reporter.step(step, loss, lr, self.state.counters.get("tokens"))
        self.status.progress(step)

    def _maybe_evaluate(self, step: int) -> None:
        due = [p.name for p in self.program.evals if p.every and step % p.every == 0]
        if due:
            self._evaluate(step, due)

    def _evaluate(self, step: int, names: Sequence[str]) -> None:
        """Ask the eval plugin to run the named passes, as storage is asked to write;
        one a signal stops reports nothing and stays in ``evals_pending``."""
        self._report_unreported()
        self.state = self.state.owing(names)
        assert self.evaluator is not None  # train() asked for it: the program has passes
        for eval_pass in [p for p in self.program.evals if p.name in names]:
            self.failing_as = f"the pass '{eval_pass.name}' after step {step}"
            try:
                numbers = self.evaluator.run_pass(
                    eval_pass,
                    self.trainer,
                    seed=self.program.run.seed,
                    open_batches=lambda p, seed: open_batches(
                        self.catalog,
                        p.data,
                        trainer=self.trainer,
                        generator=p.generator,
                        seed=seed,
                        stopping=self.stops.pass_may_stop,
                    ),
                    stopping=self.stops.pass_may_stop,
                    group=self.group,
                )
            except Exception:
                with contextlib.suppress(Exception):  # the step is committed: keep it
                    self._checkpoint(finished=False)  # (the pass pending)
                    self.outputs.wait_for_checkpoint()
                raise
            self.failing_as = None
            if numbers is None:
                return
            for name, value in numbers.items():
                self.metrics.point(step, f"{eval_pass.name}/{name}", value)
            self.reporter.evaluated(step, eval_pass.name, numbers)
            self.state = self.state.owing(
                [n for n in self.state.evals_pending if n != eval_pass.name]
            )

    def _checkpoint(self, *, finished: bool) -> None:
        """Checkpoint the current step (written and reported in the background)."""
        if self.outputs.checkpointer is not None:
            self._report_unreported()
            self.outputs.checkpoint(
                self.state, session=self.session, group=self.group, finished=finished
            )

    def _interrupted(self, generating: bool = False) -> RunOutcome:
        # The spec's order: the stop is named and reported, then its checkpoint written.
        self._report_unreported()
        name, signum = self.stops.settle()
        passes = [p for p in self.program.evals if p.name in self.state.evals_pending]
        tail = " while generating" if generating or any(p.generator for p in passes) else ""
        self.metrics.annotation(self.step, f"interrupted by {name} at step {self.step}{tail}")
        if self.step > 0:
            self._checkpoint(finished=False)
            self.outputs.wait_for_checkpoint()
        check_replicas(self.group, self.trainer, self.step)
        self._finish("interrupted")
        return RunOutcome(128 + signum, f"interrupted by {name} at step {self.step}", self.step)

    def _failed(self, line: str, code: str | None = None) -> RunOutcome:
        try:
            self.outputs.wait_for_checkpoint()
        except SexpError as write_error:
            self.log.error("checkpoint failed", error=str(write_error))
        self.metrics.annotation(self.step, f"failed: {line}")
        self._finish("failed", error=line)
        return RunOutcome(1, line, self.step, code)

    def _finish(self, state: str, error: str | None = None) -> None:
        """Write the last status, drain the metrics, stop the writer, tell the summary."""
        self.reporter.close()
        summary = self.outputs.close(state, self.step, error, self.options.metrics_wait)
        self.watch.ended()  # from `run <state>` on, no signal changes the outcome
        self.reporter.summary(state, self.step, **summary)
