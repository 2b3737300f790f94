"""The eval-pass runner: what a run calls at a pass's steps and ``sexpgpu evaluate``
calls on a checkpoint, so both give the same numbers from the same parameters."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sexpgpu.extension import DataLoader, EvalMetricInfo, Trainer

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
        open_data: Callable[[Any, int], DataLoader],
        stopping: Callable[[], bool],
    ) -> dict[str, float] | None:
        """The pass's numbers: each metric's per-batch value summed over the batches in
        order, divided by their count, then finished; ``None`` once ``stopping()``."""
        loader = open_data(eval_pass.data, seed + EVAL_SEED_OFFSET)
        batches = max(1, eval_pass.batches)
        totals: dict[str, float] = {}
        generator = getattr(eval_pass, "generator", None)
        for index in range(batches):
            if stopping():
                return None  # a pass in flight stops at its next batch and reports nothing
            batch = loader.next_batch()
            if generator is not None:  # its draws: the same at every pass, as its data
                batch = trainer.generate(
                    generator,
                    batch,
                    seed=seed + EVAL_SEED_OFFSET,
                    draw=("batch", index),
                    stopping=stopping,
                )
                if batch is None:
                    return None  # abandoned between two trips
            for name, value in trainer.evaluate(eval_pass.name, batch).items():
                totals[name] = totals.get(name, 0.0) + value
        numbers = {}
        for name, total in totals.items():
            finish = self.finishers.get(name)
            mean = total / batches
            numbers[name] = finish(mean) if finish is not None else mean
        return numbers
