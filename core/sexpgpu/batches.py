"""Where batches come from: the one part of the loop and the eval passes that knows what
a batch is. A :class:`Batches` is a loader whose batches a generator (``(sample ...)``)
makes into records, drawn from the seed and the draw's place (``("step", n)``,
``("batch", i)``), or ``None`` when a signal abandons the generation between trips.
:class:`StageBatches` are a run's training batches, a stage's at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sexpgpu.catalog import Catalog
    from sexpgpu.extension import DataLoader, DataSourceInfo, RankGroup, Trainer
    from sexpgpu.lang.ir import DataDecl, Generator, Program

Batch = Mapping[str, Any]

COMPLETION_MASK = "completion-mask"
"""The field of a generator's records that marks the tokens it made."""


@dataclass
class Batches:
    """A loader's batches, made into records by ``generator`` (when there is one) through
    the ``trainer``, drawn from ``seed``; ``stopping`` abandons a generation."""

    info: DataSourceInfo
    loader: DataLoader
    trainer: Trainer
    generator: Generator | None
    seed: int
    stopping: Callable[[], bool]

    def made(self, batch: Batch, draw: tuple[Any, ...]) -> Batch | None:
        """``batch``, or the records the generator makes from its prompts at ``draw``;
        ``None`` when a signal abandoned the generation."""
        if self.generator is None:
            return batch
        return self.trainer.generate(
            self.generator, batch, seed=self.seed, draw=draw, stopping=self.stopping
        )


def open_batches(
    catalog: Catalog,
    decl: DataDecl,
    *,
    trainer: Trainer,
    generator: Generator | None,
    seed: int,
    stopping: Callable[[], bool],
) -> Batches:
    """The batches of ``decl``'s data from ``seed`` (its loader's stream and every draw)."""
    from sexpgpu.session import open_loader

    info, loader = open_loader(catalog, decl, seed)
    return Batches(info, loader, trainer, generator, seed, stopping)


class StageBatches:
    """A run's training batches (see the module docstring)."""

    def __init__(
        self,
        catalog: Catalog,
        program: Program,
        trainer: Trainer,
        group: RankGroup,
        stopping: Callable[[], bool],
    ) -> None:
        self.catalog, self.program, self.trainer = catalog, program, trainer
        self.group, self.stopping = group, stopping
        self.current: Batches | None = None
        self.stage = -1

    def start(self, stage: int, position: Mapping[str, Any] | None = None) -> None:
        """Open ``stage``'s batches, its loader at ``position`` (a checkpoint's) if given."""
        decl = self.program.stages[stage]
        self.current = open_batches(
            self.catalog, decl.data, trainer=self.trainer, generator=decl.generator,
            seed=self.program.run.seed, stopping=self.stopping,
        )  # fmt: skip
        self.stage = stage
        if position is not None:
            self.current.loader.restore(position)

    def position(self) -> Mapping[str, Any] | None:
        """Where the current stage's loader is (what a checkpoint records)."""
        return None if self.current is None else self.current.loader.position()

    def take(self, step: int, stage: int) -> Batch | None:
        """This rank's part of step ``step``'s batch, or its generator's records from it;
        ``None`` when a signal abandons the generation: its prompts are given back, and
        a stage it opened gives way to the one before."""
        kept = (self.current, self.stage)
        if stage != self.stage:
            self.start(stage)
        source = self.current
        assert source is not None
        given = source.loader.position() if source.generator is not None else None
        part = source.loader.next_part(self.group.rank, self.group.size)  # this rank's rows
        records = source.made(part, ("step", step))
        if records is None:
            if given is not None:
                source.loader.restore(given)
            self.current, self.stage = kept
        return records

    def counted(self, batch: Batch, counters: Mapping[str, int]) -> dict[str, int]:
        """What step's ``batch`` (this rank's part: the ranks' parts are of one size)
        adds to the run's records and to each of ``counters`` it keeps."""
        assert self.current is not None
        first, size = next(iter(batch.values())), self.group.size
        records = (int(first.shape[0]) if getattr(first, "shape", ()) else 1) * size
        added = {"records": records}
        if "tokens" in counters:
            added["tokens"] = int(batch[self.current.info.tokens_field].size) * size
        if "generated" in counters and COMPLETION_MASK in batch:
            made = float(batch[COMPLETION_MASK].sum())
            added["generated"] = int(self.group.sum([made])[0])
        return added
