"""The training loop: compile, check the checkpoint location, lower, train, checkpoint, stop.

Read it top to bottom: :func:`run` sets a run up and hands it to
:class:`Run`, whose :meth:`Run.train` is the step loop. A step takes a batch,
lets the trainer propose new parameters and states, checks the proposal when
the finite guard is on, and commits it; counters and the step number advance
only on commit. Checkpoints are snapshotted in the loop and written by a
background thread, so the loop is blocked only for the host copy.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sexpgpu.errors import (
    CheckpointError,
    PluginError,
    RunError,
    SexpError,
    StorageError,
    UsageError,
)
from sexpgpu.extension import DataLoader, DataSourceInfo, OptimizerInfo, Trainer
from sexpgpu.graph import DataDecl, Program
from sexpgpu.log import get_logger
from sexpgpu.plugins import get_plugins
from sexpgpu.schedule import lr_at
from sexpgpu.signals import Interrupted, StopWatch

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
    progress: bool = False


@dataclass
class RunOutcome:
    """How a run ended: the exit code and the line to print (``None`` for a normal end)."""

    exit_code: int
    message: str | None
    step: int


def run(options: RunOptions) -> RunOutcome:
    """Run a `.sx` file as ``sexpgpu run`` does; signals are handled while it runs."""
    watch = StopWatch()
    watch.install()
    try:
        active = Run()
        try:
            active.set_up(options, watch)
        except Interrupted as stop:
            # Nothing to save yet: the step is the one the run would have started from.
            step = getattr(active, "step", 0)
            return RunOutcome(
                128 + stop.signum, f"interrupted by {stop.args[0]} at step {step}", step
            )
        return active.train()
    finally:
        watch.uninstall()


def lower_program(
    program: Program, *, device: str = "cpu", pinned: Mapping[str, str] | None = None
) -> Trainer:
    """Lower ``program`` for ``device`` as a run does: the lowering that serves the
    device kind, every available kernel and optimizer, ``pinned`` choices taken."""
    kind = device.split(":", 1)[0]
    plugins = get_plugins()
    info = plugins.require(
        "sexpgpu_lowerings", f"the device '{device}'", lambda item: kind in item.devices
    )
    return info.factory().lower(
        program,
        device=device,
        kernels=plugins.available("sexpgpu_kernels"),
        optimizers=_optimizers(),
        pinned=pinned,
    )


def open_data(decl: DataDecl, seed: int) -> tuple[DataSourceInfo, DataLoader]:
    """The data source a ``defdata`` names, and a loader opened on it from ``seed``."""
    info = get_plugins().require(
        "sexpgpu_data_sources", f"the data source '{decl.source}'", lambda i: i.name == decl.source
    )
    return info, info.factory(decl.options, decl.seq, decl.batch, seed)


def _optimizers() -> dict[str, OptimizerInfo]:
    return {info.name: info for info in get_plugins().available("sexpgpu_optimizers")}


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

    # ------------------------------------------------------------------ setup

    def set_up(self, options: RunOptions, watch: StopWatch) -> None:
        """Compile, check the checkpoint location, read the checkpoint to resume,
        lower and open data and metrics. Raises a SexpError for anything wrong."""
        from sexpgpu import checkpoint as ckpt
        from sexpgpu.lang import compile_file
        from sexpgpu.metrics import MetricsStream, new_slug, open_sinks
        from sexpgpu.status import StatusFile
        from sexpgpu.storage import open_location

        self.options = options
        self.watch = watch
        # The checkpoint location is proved listable and writable before anything
        # else, so a run never finds out hours in that it cannot write.
        self.storage = None
        if options.checkpoint_dir:
            self.storage = open_location(options.checkpoint_dir)
            self.storage.check_writable()
        self.log.info("compiling", file=options.file)
        program = compile_file(
            options.file, sets=dict(options.sets), variant=options.variant, steps=options.steps
        )
        self.program = program
        for param in program.params:
            if param.load is not None or param.root != "model":
                raise UsageError(
                    f"{param.pos}: {param.path}: parameters read with :load and second roots "
                    "(with-loaded) are compiled but cannot be trained yet"
                )

        resumed = None
        if options.resume:
            found = ckpt.resolve_resume(options.resume, options.checkpoint_dir)
            if found is not None:
                source_storage, key = found
                resumed = ckpt.load_checkpoint(source_storage, key, with_states=True)
                self.resumed_from = ckpt.location_of(source_storage, key)
        self.resumed = resumed

        self.optimizers = _optimizers()
        state = resumed.state if resumed else None
        self.step = int(state["step"]) if state else 0
        self.stage = int(state["stage"]) if state else 0
        self.records = int(state["records"]) if state else 0
        self.evals_pending: list[str] = list(state.get("evals_pending", [])) if state else []
        self.counters = {name: 0 for name in program.run.counters}
        if state:
            self.counters.update({k: int(v) for k, v in state.get("counters", {}).items()})
        self.devices, self.nodes = 1, 1

        moved: list[str] = []
        pinned = None
        if resumed:
            moved = ckpt.compare_for_resume(
                resumed.experiment,
                program,
                devices=self.devices,
                nodes=self.nodes,
                state_names=state_names_for(program, self.stage, self.optimizers),
            )
            if not options.fresh_choices:
                pinned = dict(resumed.experiment.get("choices", {}))

        self.trainer = lower_program(program, device=options.device, pinned=pinned)
        if resumed:
            self.trainer.restore(resumed.params, resumed.states, stage=self.stage)
            old_choices = resumed.experiment.get("choices", {})
            for site, name in sorted(self.trainer.choices.items()):
                if old_choices.get(site, name) != name:
                    moved.append(f"choice {site} {old_choices[site]} -> {name}")
        else:
            self.trainer.init_params()

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
        watch.loop_started()
        # Metrics and status: a resumed run reports into the same experiment.
        self.slug = resumed.experiment["slug"] if resumed else new_slug(_stem(options.file))
        self.run_dir = os.path.join(options.metrics_dir, self.slug)
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
        self.last_checkpoint = self.resumed_from if resumed else None
        self.status.update(
            state="running", step=self.step, checkpoint=self.last_checkpoint, slug=self.slug
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
        )
        self.progress = _Progress(0, enabled=False)
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sexpgpu-checkpoint")
        self.pending: Future | None = None
        self.pending_step: int | None = None
        self.written_step: int | None = self.step if resumed else None

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
        program = self.program
        total = program.steps
        progress = self.progress = _Progress(total, enabled=self.options.progress)
        try:
            if self.evals_pending:  # passes a signal stopped before they reported
                self._evaluate(self.step, self.evals_pending)
            if self.watch.stopping:
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
                if program.run.guard_finite:
                    bad = self.trainer.find_non_finite(proposal)
                    if bad is not None:
                        kind, name, count = bad
                        what = (
                            f"proposed parameter of {name}"
                            if kind == "parameter"
                            else f"proposed state {name}"
                        )
                        raise RunError(
                            f"the {what} has {count} values that are not finite; "
                            "nothing was committed"
                        )
                self.trainer.commit(proposal)
                self.step, self.stage = step, stage
                self._count(batch)
                loss = float(proposal.loss)
                self.metrics.point(step, "loss", loss)
                self.metrics.point(step, "lr", lr)
                for name, value in self.counters.items():
                    self.metrics.point(step, name, value)
                progress.update(step, loss, self.counters.get("tokens"))
                self.status.progress(step)
                self._maybe_evaluate(step)
                every = program.run.checkpoint_every
                if self.storage is not None and (step == total or (every and step % every == 0)):
                    self._checkpoint(finished=step == total)
                if self.watch.stopping and step < total:
                    return self._interrupted()
            self._wait_for_checkpoint()
            progress.close()
            self.metrics.done(self.step)
            self._finish("finished")
            return RunOutcome(0, None, self.step)
        except SexpError as error:
            progress.close()
            line = error.render()
            # An error in a step is named by that step; a checkpoint write that
            # failed names its own step.
            if not isinstance(error, (CheckpointError, StorageError)):
                line = f"step {self.step + 1}: {line}"
            return self._failed(line, error)
        except Exception as error:  # a bug or an op failing at run time: one line, traceback kept
            progress.close()
            line = f"{type(error).__name__}: {error}".splitlines()[0]
            with open(os.path.join(self.run_dir, "traceback.txt"), "w") as f:
                traceback.print_exc(file=f)
            return self._failed(
                f"step {self.step + 1}: {line} (traceback in {self.run_dir}/traceback.txt)", error
            )

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
        """Run the named passes; one a signal stops stays in ``evals_pending``."""
        self.evals_pending = list(names)
        for eval_pass in [p for p in self.program.evals if p.name in names]:
            # Eval data is its own stream, the same at every pass and on every resume.
            _, loader = open_data(eval_pass.data, self.program.run.seed + 1)
            totals: dict[str, float] = {}
            for _ in range(max(1, eval_pass.batches)):
                if self.watch.stopping:
                    return  # a pass in flight stops at its next batch and reports nothing
                for name, value in self.trainer.evaluate(
                    eval_pass.name, loader.next_batch()
                ).items():
                    totals[name] = totals.get(name, 0.0) + value
            for name, value in totals.items():
                self.metrics.point(
                    step, f"{eval_pass.name}/{name}", value / max(1, eval_pass.batches)
                )
            self.evals_pending.remove(eval_pass.name)

    # ------------------------------------------------------------ checkpoints

    def _checkpoint(self, *, finished: bool) -> None:
        """Snapshot now; write in the background (the previous write is waited for first)."""
        from sexpgpu import checkpoint as ckpt

        if self.written_step == self.step:
            return
        self._wait_for_checkpoint()
        started = time.perf_counter()
        # The previous checkpoint's write has finished: its host arrays can be reused.
        params, states = self.trainer.export(reuse=True)
        blocked = time.perf_counter() - started
        state = ckpt.state_record(
            step=self.step,
            stage=self.stage,
            records=self.records,
            counters=self.counters,
            loader=self.loader.position() if self.loader is not None else None,
            seed=self.program.run.seed,
            evals_pending=self.evals_pending,
        )
        experiment = ckpt.experiment_record(
            self.program,
            choices=self.trainer.choices,
            slug=self.slug,
            devices=self.devices,
            nodes=self.nodes,
            finished=finished,
            state_names=state_names_for(self.program, self.stage, self.optimizers),
        )
        step = self.step
        self.written_step = step
        self.pending_step = step

        def write() -> tuple[str, float, float]:
            key = ckpt.write_checkpoint(self.storage, step, params, states, state, experiment)
            return key, time.perf_counter() - started, blocked

        self.pending = self.writer.submit(write)
        if finished:
            self._wait_for_checkpoint()

    def _wait_for_checkpoint(self) -> None:
        if self.pending is None:
            return
        pending, step = self.pending, self.pending_step
        self.pending = None
        try:
            key, seconds, blocked = pending.result()
        except SexpError:
            self.written_step = None
            raise
        except Exception as error:
            self.written_step = None
            raise CheckpointError(
                f"writing the checkpoint of step {step} failed: {error}"
            ) from error
        from sexpgpu.checkpoint import location_of

        location = location_of(self.storage, key)
        self.last_checkpoint = location
        # seconds: first tensor leaving the device to the last byte stored (the spec);
        # blocked: how long of that the step loop waited (the host copy).
        self.metrics.annotation(
            step, f"checkpoint {location}", seconds=round(seconds, 6), blocked=round(blocked, 6)
        )
        self.status.update(checkpoint=location, step=self.step)
        self.progress.clear()
        self.log.info("checkpoint", location=location, step=step, seconds=round(seconds, 3))

    # ---------------------------------------------------------------- endings

    def _interrupted(self) -> RunOutcome:
        name, signum = self.watch.name, int(self.watch.signum)
        self.metrics.annotation(self.step, f"interrupted by {name} at step {self.step}")
        if self.storage is not None and self.step > 0:
            self._checkpoint(finished=False)
            self._wait_for_checkpoint()
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
        fields: dict[str, Any] = {
            "state": state,
            "step": self.step,
            "checkpoint": self.last_checkpoint,
        }
        if error is not None:
            fields["error"] = error
        self.status.update(**fields)
        undelivered = self.metrics.close(timeout=30.0)
        self.writer.shutdown(wait=True)
        self.log.info(
            f"run {state}",
            step=self.step,
            metrics=os.path.join(self.run_dir, "events.jsonl"),
            status=os.path.join(self.run_dir, "status.json"),
            checkpoint=self.last_checkpoint,
            **({"undelivered_events": undelivered} if undelivered else {}),
        )


def _stem(path: str) -> str:
    base = os.path.basename(path)
    return base[:-3] if base.endswith(".sx") else base


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


class _Progress:
    """A progress line on a terminal (step/total, loss, tokens/s, ETA); nothing otherwise."""

    def __init__(self, total: int, *, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self.total = total
        self.started = time.perf_counter()
        self.first_step: int | None = None
        self.first_tokens = 0
        self.last_draw = 0.0

    def update(self, step: int, loss: float, tokens: int | None) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.first_step is None:
            self.first_step, self.first_tokens, self.started = step, tokens or 0, now
            return
        if now - self.last_draw < 0.1 and step != self.total:
            return
        self.last_draw = now
        elapsed = max(now - self.started, 1e-9)
        per_step = elapsed / max(1, step - self.first_step)
        eta = per_step * (self.total - step)
        rate = (
            f"  {((tokens or 0) - self.first_tokens) / elapsed:,.0f} tok/s"
            if tokens is not None
            else ""
        )
        # \x1b[K clears what a longer line before it left behind.
        sys.stderr.write(
            f"\rstep {step}/{self.total}  loss {loss:.4f}{rate}  ETA {eta:,.0f}s\x1b[K"
        )
        sys.stderr.flush()

    def clear(self) -> None:
        """Clear the line so that a log line can take its place; the next update redraws."""
        if self.enabled and self.first_step is not None:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.first_step is not None:
            sys.stderr.write("\n")
            sys.stderr.flush()
