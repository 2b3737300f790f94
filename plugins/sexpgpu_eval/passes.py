"""The eval-pass runner: what a run calls at a pass's steps and ``sexpgpu evaluate``
calls on a checkpoint, so both give the same numbers from the same parameters."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sexpgpu.batches import Batches
from sexpgpu.extension import EvalMetricInfo, RankGroup, Trainer

EVAL_SEED_OFFSET = 1
"""Eval data is its own stream, seeded ``run seed + 1``: the same batches at every
pass, on every resume and in ``sexpgpu evaluate``."""


class PassRunner:
    """The :class:`sexpgpu.extension.Evaluator` of the ``eval`` plugin."""

    def __init__(self, metrics: Mapping[str, EvalMetricInfo]) -> None:
        self.finishers = {name: info.finish for name, info in metrics.items() if info.finish}

    def run_pass(
        self,
        eval_pass: Any,
        trainer: Trainer,
        *,
        seed: int,
        open_batches: Callable[[Any, int], Batches],
        stopping: Callable[[], bool],
        group: RankGroup | None = None,
    ) -> dict[str, float] | None:
        """The pass's numbers: each metric's per-batch value summed over the batches in
        order, divided by their count, then finished; ``None`` once ``stopping()``.

        With the ``group`` of several ranks, rank ``r`` of ``n`` evaluates batches
        ``r``, ``r + n``...; the ranks then add up each batch's values (every slot
        but its own rank's is zero, so each value comes through exact), and every
        rank sums them in batch order: one rank's numbers, to the bit, when each
        batch computes as it does alone."""
        # its data and its generator's draws: the same at every pass
        source = open_batches(eval_pass, seed + EVAL_SEED_OFFSET)
        batches = max(1, eval_pass.batches)
        rank, size = (group.rank, group.size) if group is not None else (0, 1)
        if batches < size and trainer.evaluates_together:
            rank, size = 0, 1  # its first evaluate is a collective: every rank runs every batch
        names = list(eval_pass.metrics)
        values = [0.0] * (batches * len(names))  # batch by batch, metric by metric
        for index in range(batches):
            if stopping():
                return None  # a pass in flight stops at its next batch and reports nothing
            batch = source.loader.next_batch()  # every rank reads the stream, in order
            if index % size != rank:
                continue
            batch = source.made(batch, ("batch", index))
            if batch is None:
                return None  # its generation abandoned between two trips
            numbers = trainer.evaluate(eval_pass.name, batch)
            for k, name in enumerate(names):
                values[index * len(names) + k] = numbers[name]
        if group is not None and size > 1:
            values = group.sum(values)
        totals = dict.fromkeys(names, 0.0)
        for index in range(batches):
            for k, name in enumerate(names):
                totals[name] += values[index * len(names) + k]
        numbers = {}
        for name, total in totals.items():
            finish = self.finishers.get(name)
            mean = total / batches
            numbers[name] = finish(mean) if finish is not None else mean
        return numbers
