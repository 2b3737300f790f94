"""What a run writes besides its tensors (checkpoint location, metrics, status file,
checkpointer), opened at its start and closed in order at its end; and the :class:`Reporter`.

Rank 0 writes for every rank: the others get a metrics stream with no sink and a status
file that writes nothing, so the step loop says the same things on every rank.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sexpgpu.errors import RunError
from sexpgpu.status import STATUS_FILE

if TYPE_CHECKING:
    from sexpgpu.catalog import Catalog
    from sexpgpu.checkpoint.checkpointer import Checkpointer, LentExports
    from sexpgpu.extension import RankGroup, Storage
    from sexpgpu.metrics import MetricsStream
    from sexpgpu.session import Session
    from sexpgpu.state import RunState
    from sexpgpu.train import RunOptions


def open_location(
    catalog: Catalog, checkpoint_dir: str | None, group: RankGroup, log: Any
) -> Storage | None:
    """The checkpoint location, proved listable and writable first (not found out hours in);
    ``None``, with a warning said once, when there is none."""
    if checkpoint_dir:
        storage = catalog.open_location(checkpoint_dir)
        if group.is_writer:  # the other ranks only read (a checkpoint to resume)
            storage.check_writable()
        return storage
    if group.is_writer:  # said once, by rank 0
        log.warning(
            "no checkpoint location: nothing will be saved, and a signal or a crash loses the run",
            hint="--checkpoint-dir or SEXPGPU_CHECKPOINT_DIR",
        )
    return None


class Reporter(Protocol):
    """What the person watching a run is told (the CLI draws a progress bar and logs
    lines); each method tells nothing unless a subclass says otherwise."""

    def step(self, step: int, loss: float, lr: float, tokens: int | None) -> None:
        """A committed step."""

    def evaluated(self, step: int, name: str, numbers: dict[str, float]) -> None:
        """An eval pass's numbers."""

    def close(self) -> None:
        """Stop drawing (the run's end, or a failure on the way)."""

    def summary(self, state: str, step: int, **fields: Any) -> None:
        """How the run ended (``finished``, ``interrupted``, ``failed``), with ``fields``."""


class Quiet(Reporter):
    """The :class:`Reporter` of a run called as a library: it tells nothing."""


@dataclass
class Outputs:
    """A run's metrics stream, status file and checkpointer (``None`` without a
    checkpoint location, or on a rank that does not write)."""

    slug: str
    run_dir: str
    metrics: MetricsStream
    status: Any
    checkpointer: Checkpointer | LentExports | None
    resumed_from: str | None
    events: str | None = None  # where a person finds the events: the first sink's location

    @classmethod
    def open(
        cls, *, options: RunOptions, session: Session, state: RunState, group: RankGroup,
        storage: Storage | None, compile_seconds: float | None, moved: list[str], log: Any,
    ) -> Outputs:  # fmt: skip
        """Open what a run writes in its experiment (a resumed run's: the same), and say that
        it started, or resumed (with what ``moved`` since its checkpoint)."""
        from sexpgpu.checkpoint.checkpointer import lent_exports
        from sexpgpu.metrics import MetricsStream, new_slug

        resumed = session.checkpoint
        stem = os.path.basename(options.selection.file).removesuffix(".sx")
        slug = resumed.experiment["slug"] if resumed else new_slug(stem)
        run_dir = os.path.join(options.metrics_dir, slug)
        # a resumed checkpoint is not written again, unless it owes passes
        written = state.step if resumed and not state.evals_pending else None
        trainer = session.lowered.trainer if session.lowered else None
        if not group.is_writer:  # rank 0 reports and writes for every rank
            lent = lent_exports(trainer, storage, written)
            return cls(slug, run_dir, MetricsStream([], experiment=slug), _Unwritten(), lent, None)
        outputs = cls._for_writer(options, session, state.step, storage, slug, run_dir, written)
        if resumed or moved:  # resumed, or a fresh start's choices made otherwise than its source's
            lines = [f"resumed from {session.location}"] if resumed else []
            outputs.metrics.annotation(state.step, "\n".join([*lines, *moved]))
        fields = {} if compile_seconds is None else {"compile_seconds": compile_seconds}
        log.info(
            "run started" if not resumed else "run resumed",
            file=options.selection.file,
            slug=slug,
            device=options.target.device,
            parameters=sum(math.prod(p.type.shape) for p in session.program.params),
            steps=session.program.steps,
            step=state.step,
            choices=dict(session.made),
            **fields,
        )
        return outputs

    @classmethod
    def _for_writer(
        cls, options: RunOptions, session: Session, step: int, storage: Storage | None,
        slug: str, run_dir: str, written: int | None,
    ) -> Outputs:  # fmt: skip
        from sexpgpu.checkpoint.checkpointer import Checkpointer
        from sexpgpu.metrics import MetricsStream, open_sinks
        from sexpgpu.status import StatusFile, run_identity

        catalog, program = session.catalog, session.program
        made = _missing_folders(run_dir)
        try:
            os.makedirs(run_dir, exist_ok=True)
        except OSError as exc:
            # a user's folder (a file in the way, no permission): one line, not a traceback
            raise RunError(
                f"cannot use {options.metrics_dir} as the metrics folder: {exc.strerror or exc}"
            ) from None
        names = list(options.metrics_sinks)
        there = set(os.listdir(run_dir))
        try:
            sinks = open_sinks(names, options.metrics_dir, slug, catalog)
        except BaseException:
            _take_back(run_dir, made, there)
            raise
        metrics = MetricsStream(sinks, experiment=slug)
        where = [catalog.metrics_sink(name).location for name in names]
        found = [at(options.metrics_dir, slug) for at in where if at is not None] + [run_dir]
        status = StatusFile(os.path.join(run_dir, STATUS_FILE))
        resumed_from = session.location if session.checkpoint else None
        status.update(
            state="running",
            step=step,
            checkpoint=resumed_from,
            slug=slug,
            **run_identity(options.selection.file, program, session.made),
        )
        checkpointer = None
        if storage is not None:
            keep = options.keep_last if options.keep_last is not None else program.run.keep_last
            checkpointer = Checkpointer(
                storage,
                session.lowered.trainer,
                metrics=metrics,
                status=status,
                keep_last=keep,
                passes=[(p.name, p.every) for p in program.evals],
                resumed_from=resumed_from,
                written_step=written,
            )
        return cls(slug, run_dir, metrics, status, checkpointer, resumed_from, found[0])

    @property
    def last_checkpoint(self) -> str | None:
        """The newest checkpoint stored (or resumed from), as its location."""
        return self.resumed_from if self.checkpointer is None else self.checkpointer.last

    def checkpoint(
        self, state: RunState, *, session: Session, group: RankGroup, finished: bool
    ) -> None:
        """Checkpoint the run at ``state``: snapshot now, written and reported in the
        background (waited for when ``finished``)."""
        from sexpgpu import checkpoint as ckpt
        from sexpgpu.session import state_names_for

        program = session.program

        def experiment() -> dict[str, Any]:
            return ckpt.experiment_record(
                program,
                choices=session.made,
                slug=self.slug,
                devices=group.size,
                nodes=group.nodes,
                finished=finished,
                state_names=state_names_for(program, state.stage, session.catalog),
                loaded=session.loaded,
                root=session.root,
            )

        assert self.checkpointer is not None
        self.checkpointer.save(
            state.step,
            state=lambda: state.record(program.run.seed),
            experiment=experiment,
            wait=finished,
        )

    def wait_for_checkpoint(self) -> None:
        """Return once the checkpoint being written is stored (raises if it failed)."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def close(self, state: str, step: int, error: str | None, wait: float) -> dict[str, Any]:
        """Stop the writer, write the last status, drain the metrics for up to ``wait``
        seconds; returns the summary's fields (where the checkpoint, metrics, status are)."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        fields: dict[str, Any] = {"state": state, "step": step, "checkpoint": self.last_checkpoint}
        if error is not None:
            fields["error"] = error
        self.status.update(**fields)
        undelivered = self.metrics.close(timeout=wait)
        summary: dict[str, Any] = {
            "checkpoint": self.last_checkpoint,
            "metrics": self.events or self.run_dir,
            "status": os.path.join(self.run_dir, STATUS_FILE),
        }
        if undelivered:
            # A metrics folder that filled up or went away mid-run: said at the end too.
            summary["undelivered_events"] = undelivered
            summary["undelivered_by_sink"] = dict(self.metrics.undelivered_by_sink)
            summary["metrics_errors"] = dict(self.metrics.errors_by_sink)
        if self.status.unwritten is not None:
            summary["status_unwritten"] = self.status.unwritten
        return summary


class _Unwritten:
    """The status file of a rank that does not write one (every rank but 0): nothing to write."""

    unwritten = None

    def update(self, **fields: object) -> bool:
        return True

    def progress(self, step: int, **fields: object) -> bool:
        return True


def _missing_folders(path: str) -> list[str]:
    """``path`` and the folders above it that do not exist yet, deepest first."""
    missing = []
    while path and not os.path.lexists(path) and path not in missing:  # a root is its own parent
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _take_back(run_dir: str, made: list[str], there: set[str]) -> None:
    """A run refused while opening its sinks leaves nothing behind: the run folder it made
    goes, else the empty files the sinks made in it, then each folder made above, while empty."""
    import shutil

    if run_dir in made:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        for name in set(os.listdir(run_dir)) - there:
            path = os.path.join(run_dir, name)
            if os.path.isfile(path) and not os.path.islink(path) and not os.path.getsize(path):
                os.unlink(path)
    for folder in made:
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            continue  # the run folder, removed whole above
        except OSError:
            break  # not empty: someone else's now
