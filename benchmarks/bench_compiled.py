"""Steps per second of the compiled lowering against the same model hand-written in
PyTorch and put through ``torch.compile``, interleaved in one process.

    .venv/bin/python benchmarks/bench_compiled.py [--steps 20] [--rounds 7] [--threads 1]
        [--set dim=256 --set layers=4 --set heads=8] [--update fused|compiled]

The model is examples/tiny-lm.sx (by default at dim=256, layers=4, heads=8). Both
sides compile before timing (the warm-up steps also check that they compute the
same losses); then rounds of ``--steps`` steps alternate between them, so both see
the same machine load. ``--update`` pins the choice ``optimizer.update`` (a new
run's default otherwise: ``fused``). Prints each side's median steps/s with its spread (min-max
over rounds) and the ratio compiled / hand-written (goal >= 0.97). Both sides read
the loss on the host every step, as a run's progress line does.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import EXAMPLE, _hand_written  # noqa: E402


def main() -> None:
    """Measure and print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per side")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--set", dest="sets", action="append", default=None, metavar="K=V")
    parser.add_argument("--update", choices=("fused", "compiled"), help="optimizer.update")
    args = parser.parse_args()
    sets = dict(s.split("=", 1) for s in (args.sets or ["dim=256", "layers=4", "heads=8"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch

    torch.set_num_threads(args.threads)
    from sexpgpu.catalog import Catalog
    from sexpgpu.lang.schedule import lr_at
    from sexpgpu.session import Selection, Target, lower, open_loader
    from sexpgpu_torch.names import UPDATE

    catalog = Catalog.load()
    program = Selection(str(EXAMPLE), sets=sets).compile(catalog)
    started = time.perf_counter()
    pinned = {UPDATE: args.update} if args.update else {}
    choices = Target(lowering="compiled", requests=pinned).choices(program, None)
    trainer = lower(program, catalog, device="cpu", choices=choices).trainer
    trainer.warm_up()  # as a run does: every graph compiled before the first step
    ours_compile = time.perf_counter() - started
    trainer.init_params()
    stage = program.stages[0]
    _, loader = open_loader(catalog, stage.data, program.run.seed)
    warm = 5
    total = warm + args.steps * args.rounds
    batches = [loader.next_batch() for _ in range(total)]
    lrs = [lr_at(stage.optimizer, s, total) for s in range(1, total + 1)]
    hand = _hand_written(trainer.export()[0], program, "math", compile_model=True)

    def ours(i: int) -> float:
        proposal = trainer.propose(batches[i], stage=0, step=i + 1, lr=lrs[i])
        trainer.commit(proposal)
        return proposal.loss

    started = time.perf_counter()
    hand(batches[0], lrs[0])  # compiles the hand-written side
    hand_compile = time.perf_counter() - started
    ours(0)
    for i in range(1, warm):
        a, b = ours(i), hand(batches[i], lrs[i])
        if not math.isclose(a, b, rel_tol=1e-3):
            sys.exit(f"the two sides disagree at step {i + 1}: loss {a} against {b}")

    rates: dict[str, list[float]] = {"compiled": [], "pytorch": []}
    i = warm
    for _ in range(args.rounds):
        for name, fn in (("compiled", ours), ("pytorch", lambda j: hand(batches[j], lrs[j]))):
            start = time.perf_counter()
            for j in range(i, i + args.steps):
                fn(j)
            rates[name].append(args.steps / (time.perf_counter() - start))
        i += args.steps

    knobs = " ".join(f"{k}={v}" for k, v in sets.items())
    update = trainer.choices.get(UPDATE)
    print(
        f"examples/tiny-lm.sx ({knobs}) on cpu, {args.threads} thread(s), attention math, "
        f"update {update}"
    )
    # both sides compile in this one process, the hand-written one second, on the
    # caches and headers the first left: no comparison (bench_compile_time.py is)
    print(
        f"  compile in this process: sexpgpu {ours_compile:.1f} s, then hand-written "
        f"{hand_compile:.1f} s (warm; bench_compile_time.py compares them cold)"
    )
    for name, values in rates.items():
        print(
            f"  {name:9} steps/s  median {statistics.median(values):8.2f}  "
            f"spread {min(values):.2f}-{max(values):.2f}"
        )
    ratios = [a / b for a, b in zip(rates["compiled"], rates["pytorch"], strict=True)]
    ratio = statistics.median(rates["compiled"]) / statistics.median(rates["pytorch"])
    print(
        f"  ratio compiled / torch.compile   {ratio:.3f}   per round {min(ratios):.3f}-"
        f"{max(ratios):.3f}   (goal >= 0.97)"
    )


if __name__ == "__main__":
    main()
