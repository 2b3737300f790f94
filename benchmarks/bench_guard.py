"""What the finite guard costs: step time of examples/tiny-lm.sx with and without it.

Both are measured in the same process, interleaved in rounds so that machine
noise falls on both alike; the figure is the ratio of medians (goal <= 1.03).

    python benchmarks/bench_guard.py [--steps 40] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from sexpgpu.catalog import Catalog
from sexpgpu.choices import Choices
from sexpgpu.lang.schedule import lr_at
from sexpgpu.session import Selection, lower, open_loader

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-lm.sx"


def build():
    catalog = Catalog.load()
    program = Selection(str(EXAMPLE)).compile(catalog)
    trainer = lower(program, catalog, device="cpu", choices=Choices()).trainer
    trainer.init_params()
    stage = program.stages[0]
    _, loader = open_loader(catalog, stage.data, program.run.seed)
    batches = [loader.next_batch() for _ in range(8)]
    return program, trainer, batches


def time_steps(program, trainer, batches, steps: int, guard: bool, first_step: int) -> float:
    stage = program.stages[0]
    started = time.perf_counter()
    for i in range(steps):
        step = first_step + i
        lr = lr_at(stage.optimizer, min(step, stage.steps), stage.steps)
        proposal = trainer.propose(batches[i % len(batches)], stage=0, step=step, lr=lr)
        if guard:
            assert trainer.find_non_finite(proposal) is None
        trainer.commit(proposal)
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    program, trainer, batches = build()
    time_steps(program, trainer, batches, 5, True, 1)  # warm up
    plain, guarded = [], []
    step = 6
    for _ in range(args.rounds):
        plain.append(time_steps(program, trainer, batches, args.steps, False, step))
        step += args.steps
        guarded.append(time_steps(program, trainer, batches, args.steps, True, step))
        step += args.steps
    p, g = statistics.median(plain), statistics.median(guarded)
    print(f"tiny-lm step without guard: {p * 1e3:.3f} ms (median of {args.rounds} rounds)")
    print(f"tiny-lm step with guard:    {g * 1e3:.3f} ms")
    print(f"guard overhead ratio:       {g / p:.4f} (goal <= 1.03)")


if __name__ == "__main__":
    main()
