"""Evaluating checkpoints and reporting their numbers: one checkpoint, or every new
one of a run as it is written (``--follow``), with ``evaluated.json``.

``evaluated.json`` (:mod:`sexpgpu.checkpoint.evaluated`) sits beside the
``step-<n>`` folders: each pass's evaluated steps. A follower writes it as it
starts, which tells the run's retention to keep what it has not evaluated, within
a bound; it is rewritten whole (one object write) after each pass, once that
pass's points have reached every metrics sink, so a step it lists has been
delivered; a follower killed between the two evaluates that step again. A due
step deleted before the follower read it (past the bound) is reported, each one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click

from sexpgpu.batches import open_batches
from sexpgpu.checkpoint import (
    EXPERIMENT_FILE,
    location_of,
    parse_step_key,
    read_experiment,
    step_key,
)
from sexpgpu.checkpoint.evaluated import (
    EVALUATED_FILE,
    due_passes,
    read_evaluated,
    write_evaluated,
)
from sexpgpu.errors import CheckpointError, RunError
from sexpgpu.extension import Evaluator, Storage
from sexpgpu.log import get_logger
from sexpgpu.session import CheckpointOpener, Opened

E_UNDELIVERED = "E-EVAL-004"
"""A pass's points that did not reach every sink: the step is not marked evaluated."""
SOURCE = "evaluate"
"""The ``source`` of every point ``sexpgpu evaluate`` reports."""


class Stopped(Exception):
    """A signal stopped the evaluation; the pass in flight reported nothing."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step


@dataclass
class Reporting:
    """Where the numbers go: the run's metrics experiment, through these sinks."""

    catalog: Any
    metrics_dir: str
    sinks: tuple[str, ...]
    settle_seconds: float
    wait_seconds: float
    """How long :meth:`close` waits for the sinks to take every event."""
    streams: dict[str, Any] = field(default_factory=dict)

    def stream(self, slug: str) -> Any:
        """The metrics stream of experiment ``slug`` (opened once)."""
        from sexpgpu.metrics import MetricsStream, open_sinks

        if slug not in self.streams:
            folder = os.path.join(self.metrics_dir, slug)
            if not os.path.isdir(folder):  # another folder than the run's: say where
                click.echo(
                    f"sexpgpu evaluate: the run's metrics are not in {self.metrics_dir}; "
                    f"its numbers go to a new {folder}: give --metrics-dir the folder the "
                    "run reported to, to add them to its own",
                    err=True,
                )
            self.streams[slug] = MetricsStream(
                open_sinks(list(self.sinks), self.metrics_dir, slug, self.catalog),
                experiment=slug,
            )
        return self.streams[slug]

    def settle(self, slug: str, what: str) -> None:
        """Return once every sink has taken every event queued so far."""
        stream = self.stream(slug)
        deadline = time.monotonic() + self.settle_seconds
        while stream.pending():
            if time.monotonic() > deadline:
                raise RunError(
                    f"the points of {what} did not reach every metrics sink within "
                    f"{self.settle_seconds:g}s; {EVALUATED_FILE} does not list them",
                    code=E_UNDELIVERED,
                )
            time.sleep(0.01)

    def close(self) -> int:
        """Drain and close every stream; the count of events not delivered."""
        return sum(stream.close(timeout=self.wait_seconds) for stream in self.streams.values())


class Evaluation:
    """Evaluates checkpoints and reports their passes."""

    def __init__(
        self,
        *,
        reader: CheckpointOpener,
        runner: Evaluator,
        reporting: Reporting,
        stopping: Callable[[], bool],
        echo: Callable[[str], None],
    ) -> None:
        self.reader = reader
        self.runner = runner
        self.reporting = reporting
        self.stopping = stopping
        self.echo = echo
        self.log = get_logger("sexpgpu.evaluate")
        self._annotated: set[str] = set()

    def passes(self, opened: Opened, names: list[str] | None, done: dict[str, list[int]]) -> list:
        """The passes to run at this checkpoint: ``names`` (every pass when ``None``),
        less those ``done`` lists at its step."""
        chosen = [p for p in opened.program.evals if names is None or p.name in names]
        return [p for p in chosen if opened.step not in done.get(p.name, ())]

    def anything_due(
        self,
        storage: Storage,
        key: str,
        step: int,
        names: list[str] | None,
        done: dict[str, list[int]],
    ) -> bool:
        """Whether a pass is due at the checkpoint ``key``, from its ``experiment.json``
        alone: the finished checkpoint owes every pass, another those ``:every`` names."""
        try:
            experiment = read_experiment(storage, key)
        except CheckpointError:
            return True  # opening it says what is wrong, or that retention removed it
        if experiment.get("finished"):
            return True
        program = self.reader.program(experiment)
        return any(
            p.every and step % p.every == 0 and step not in done.get(p.name, ())
            for p in program.evals
            if names is None or p.name in names
        )

    def evaluate(
        self,
        storage: Storage,
        key: str,
        opened: Opened,
        eval_passes: list,
        mark: Callable[[str, int], None] | None = None,
    ) -> None:
        """Run ``eval_passes`` on the opened checkpoint; each pass's points are settled
        in every sink, then ``mark(pass, step)``. Raises :class:`Stopped` on a signal."""
        catalog = self.reader.catalog
        stream = self.reporting.stream(opened.slug)
        self._annotate(stream, opened)
        for eval_pass in eval_passes:
            if self.stopping():
                raise Stopped(opened.step)
            numbers = self.runner.run_pass(
                eval_pass,
                opened.trainer,
                seed=opened.program.run.seed,
                open_batches=lambda p, seed, trainer=opened.trainer: open_batches(
                    catalog,
                    p.data,
                    trainer=trainer,
                    generator=p.generator,
                    seed=seed,
                    stopping=self.stopping,
                ),
                stopping=self.stopping,
            )
            if numbers is None:
                raise Stopped(opened.step)
            tag = f"{eval_pass.name}@{opened.step}"
            for name, value in numbers.items():
                stream.point(
                    opened.step,
                    f"{eval_pass.name}/{name}",
                    value,
                    source=SOURCE,
                    evaluation=tag,
                    checkpoint=opened.location,
                )
            self.reporting.settle(opened.slug, f"{eval_pass.name} at step {opened.step}")
            shown = ", ".join(f"{n} {v:.6g}" for n, v in numbers.items())
            self.echo(f"{opened.location} {eval_pass.name}: {shown}")
            if mark is not None:
                mark(eval_pass.name, opened.step)

    def _annotate(self, stream: Any, opened: Opened) -> None:
        """What moved since the checkpoint was written, once, as ``resumed from`` says it."""
        if not opened.moved or opened.location in self._annotated:
            return
        self._annotated.add(opened.location)
        stream.annotation(
            opened.step,
            "\n".join([f"evaluated from {opened.location}", *opened.moved]),
            source=SOURCE,
        )
        self.log.warning("sources or knobs moved", checkpoint=opened.location, moved=opened.moved)


@dataclass
class Followed:
    """Where a follower ended: the finished checkpoint's step, and each due step it
    never evaluated because the run deleted it first (reported as it was found)."""

    step: int
    missed: list[int]


def follow(
    evaluation: Evaluation, storage: Storage, *, poll: float, names: list[str] | None
) -> Followed:
    """Evaluate each new complete checkpoint under ``storage`` for the passes due at its
    step, until the one whose ``experiment.json`` says ``finished``."""
    evaluated = read_evaluated(storage)
    if evaluated is None:  # said at once: the run's retention keeps what a follower owes
        evaluated = {}
        write_evaluated(storage, evaluated)

    def mark(name: str, step: int) -> None:
        evaluated[name] = sorted({*evaluated.get(name, []), step})
        write_evaluated(storage, evaluated)

    seen: set[str] = set()
    gaps = _Gaps(evaluation, storage, names)
    while True:
        listing = _steps(storage)
        gaps.look(listing, evaluated)
        for step, key in listing:
            if key in seen or not storage.exists(f"{key}/{EXPERIMENT_FILE}"):
                continue  # a checkpoint counts once its experiment.json is there
            if not evaluation.anything_due(storage, key, step, names, evaluated):
                seen.add(key)  # nothing due here: its parameters are not read
                continue
            opened = _open(evaluation, storage, key)
            seen.add(key)
            if opened is None:
                gaps.missed_at(step, evaluated)
                continue
            due = [
                p
                for p in evaluation.passes(opened, names, evaluated)
                if opened.finished or (p.every and step % p.every == 0)
            ]
            evaluation.evaluate(storage, key, opened, due, mark)
            if opened.finished:
                return Followed(step, gaps.missed)
        _wait(poll, evaluation.stopping)
        if evaluation.stopping():
            raise Stopped(max((parse_step_key(key) or 0 for key in seen), default=0))


class _Gaps:
    """Due checkpoints the follower never saw: the run deleted them first (past the
    bound its retention keeps for a follower, or before the follower started)."""

    def __init__(self, evaluation: Evaluation, storage: Storage, names: list[str] | None) -> None:
        self.evaluation = evaluation
        self.storage = storage
        self.names = names
        self.listed: set[int] = set()
        self.upto = 0
        self.missed: list[int] = []
        self.passes: list[tuple[str, int]] = []
        self.slug: str | None = None

    def look(self, listing: list[tuple[int, str]], evaluated: dict[str, list[int]]) -> None:
        """Take a listing: each due step below its newest checkpoint that was never
        listed is missed (checkpoints fall every ``:checkpoint-every`` steps)."""
        self.listed.update(step for step, _ in listing)
        newest = next((sk for sk in reversed(listing) if sk[0] > self.upto), None)
        if newest is None:
            return
        try:
            experiment = read_experiment(self.storage, newest[1])
        except CheckpointError:
            return  # being written, or gone: the next listing looks again
        program = self.evaluation.reader.program(experiment)
        self.slug = str(experiment.get("slug"))
        self.passes = [
            (p.name, p.every) for p in program.evals if self.names is None or p.name in self.names
        ]
        every = program.run.checkpoint_every
        if every:
            for step in range((self.upto // every + 1) * every, newest[0], every):
                if step not in self.listed:
                    self.missed_at(step, evaluated)
        self.upto = newest[0]

    def missed_at(self, step: int, evaluated: dict[str, list[int]]) -> None:
        """Report ``step`` as deleted before it was evaluated, if a pass was due there."""
        owed = [p for p in due_passes(self.passes, step) if step not in evaluated.get(p, ())]
        if not owed or step in self.missed:
            return
        self.missed.append(step)
        where = location_of(self.storage, step_key(step))
        self.evaluation.log.warning(
            "checkpoint deleted before it was evaluated", checkpoint=where, passes=owed
        )
        if self.slug is not None:
            self.evaluation.reporting.stream(self.slug).annotation(
                step,
                f"not evaluated: {where} ({', '.join(owed)}) was deleted before "
                "evaluate --follow read it",
                source=SOURCE,
            )


def _steps(storage: Storage) -> list[tuple[int, str]]:
    """(step, key) of every ``step-<n>`` folder, lowest first; listing errors propagate."""
    found = []
    for name in storage.list_children(""):
        step = parse_step_key(name.rstrip("/"))
        if step is not None:
            found.append((step, name.rstrip("/")))
    return sorted(found)


def _open(evaluation: Evaluation, storage: Storage, key: str) -> Opened | None:
    """The checkpoint opened, or ``None`` when retention removed it meanwhile."""
    try:
        return evaluation.reader.open(storage, key)
    except CheckpointError:
        if storage.exists(f"{key}/{EXPERIMENT_FILE}"):
            raise
        return None


def _wait(seconds: float, stopping: Callable[[], bool]) -> None:
    """Sleep ``seconds`` in short slices, returning early on a signal."""
    deadline = time.monotonic() + seconds
    while not stopping():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(0.1, left))
