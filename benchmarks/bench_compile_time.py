"""Cold compile time of the compiled lowering against the same model hand-written and
put through ``torch.compile``, each side in a fresh process with a fresh cache; and
the warm second start of the same program.

    .venv/bin/python benchmarks/bench_compile_time.py [--trials 3] [--threads 1]
        [--set dim=256 --set layers=4 --set heads=8] [--update fused|compiled]

torch keeps what it compiles on disk (``TORCHINDUCTOR_CACHE_DIR``, by default a
folder that outlives a process), and a process that has compiled once is warm for
the next compile, so a fair cold measure gives each side its own new process and its
own empty cache folder. inductor's precompiled headers live outside that folder
(``$TMPDIR/torchinductor_$USER``), so each cold side gets its own empty ``TMPDIR``
too and builds them, as on a new machine. Per trial, interleaved so both see the
same machine load:

- ``sexpgpu cold``: lower examples/tiny-lm.sx with the compiled lowering and run its
  warm-up (every stage's loss and backward, the update, every eval pass), as
  ``sexpgpu run`` does before its first step;
- ``sexpgpu warm``: the same again in a new process on the cache the cold one
  filled (a resume's start on the same machine);
- ``hand-written cold``: the model as nanoGPT writes it (``torch.compile(model)``,
  torch's AdamW, clipping) through its first training step and one eval forward
  with no grad (nanoGPT's ``estimate_loss``), so both sides compile a training and
  an eval graph.

Times exclude the interpreter's start, torch's import and the import of torch's
compiler (``torch._dynamo``, ``torch._inductor``), which both sides pay alike and
which is measured apart. Prints each median with its spread, the cold ratio
sexpgpu / hand-written (goal <= 1.3, issue 50's), and the warm start (goal <= 5 s)
with the compiler's import beside it. ``--update`` pins sexpgpu's choice
``optimizer.update`` (a new run's default otherwise: ``fused``, which compiles no
update graph; ``compiled`` compiles one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import EXAMPLE, _hand_written  # noqa: E402


def _one(side: str, sets: dict[str, str], threads: int, update: str | None) -> dict[str, float]:
    """Seconds this process takes to import torch's compiler and to compile ``side``."""
    import torch

    torch.set_num_threads(threads)
    started = time.perf_counter()
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    imported = time.perf_counter() - started
    return {"import": imported, "seconds": _compile(side, sets, update)}


def _compile(side: str, sets: dict[str, str], update: str | None) -> float:
    from sexpgpu.catalog import Catalog
    from sexpgpu.lang.schedule import lr_at
    from sexpgpu.session import Selection, Target, lower, open_loader
    from sexpgpu_torch.names import UPDATE

    catalog = Catalog.load()
    program = Selection(str(EXAMPLE), sets=sets).compile(catalog)
    if side == "sexpgpu":
        started = time.perf_counter()
        pinned = {UPDATE: update} if update else {}
        choices = Target(lowering="compiled", requests=pinned).choices(program, None)
        lower(program, catalog, device="cpu", choices=choices).trainer.warm_up()
        return time.perf_counter() - started
    # the hand-written side takes its start values from the eager lowering (no compile)
    eager = lower(
        program, catalog, device="cpu", choices=Target(lowering="torch").choices(program, None)
    ).trainer
    eager.init_params()
    stage = program.stages[0]
    _, loader = open_loader(catalog, stage.data, program.run.seed)
    batch = loader.next_batch()
    step = _hand_written(eager.export()[0], program, "math", compile_model=True)
    started = time.perf_counter()
    step(batch, lr_at(stage.optimizer, 1, 10))
    step.evaluate(batch)
    return time.perf_counter() - started


def _measure(
    side: str, cache: Path, sets: dict[str, str], threads: int, update: str | None
) -> dict[str, float]:
    (cache / "tmp").mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TMPDIR": str(cache / "tmp"),
        "OMP_NUM_THREADS": str(threads),
    }
    args = [sys.executable, __file__, "--one", side, "--threads", str(threads)]
    args += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    args += ["--update", update] if update else []
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        sys.exit(f"{side}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _line(name: str, values: list[float]) -> str:
    return (
        f"  {name:18} median {statistics.median(values):7.1f} s  "
        f"spread {min(values):.1f}-{max(values):.1f}"
    )


def main() -> None:
    """Measure and print (or, with ``--one``, measure one side in this process)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3, help="cold measures per side")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--set", dest="sets", action="append", default=None, metavar="K=V")
    parser.add_argument("--update", choices=("fused", "compiled"), help="optimizer.update")
    parser.add_argument("--one", choices=["sexpgpu", "hand"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    sets = dict(s.split("=", 1) for s in (args.sets or ["dim=256", "layers=4", "heads=8"]))
    if args.one:
        print(json.dumps(_one(args.one, sets, args.threads, args.update)))
        return
    times: dict[str, list[float]] = {"sexpgpu cold": [], "sexpgpu warm": [], "hand cold": []}
    imports: list[float] = []
    with tempfile.TemporaryDirectory(prefix="sexpgpu-compile-bench-") as scratch:
        for trial in range(args.trials):
            ours, theirs = Path(scratch) / f"ours-{trial}", Path(scratch) / f"hand-{trial}"
            for name, side, cache in (
                ("sexpgpu cold", "sexpgpu", ours),
                ("sexpgpu warm", "sexpgpu", ours),
                ("hand cold", "hand", theirs),
            ):
                measured = _measure(side, cache, sets, args.threads, args.update)
                times[name].append(measured["seconds"])
                imports.append(measured["import"])
    knobs = " ".join(f"{k}={v}" for k, v in sets.items())
    update = args.update or "fused (the default)"
    print(
        f"examples/tiny-lm.sx ({knobs}) on cpu, {args.threads} thread(s), {args.trials} "
        f"trials, update {update}"
    )
    for name, values in times.items():
        print(_line(name, values))
    print(_line("compiler import", imports) + "   (each process, both sides)")
    cold = statistics.median(times["sexpgpu cold"]) / statistics.median(times["hand cold"])
    warm = statistics.median(times["sexpgpu warm"])
    print(f"  cold ratio sexpgpu / hand-written  {cold:.2f}   (goal <= 1.3)")
    print(
        f"  warm second start  {warm:.1f} s   (goal <= 5 s; "
        f"{warm + statistics.median(imports):.1f} s with the compiler's import)"
    )


if __name__ == "__main__":
    main()
