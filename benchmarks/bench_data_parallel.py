"""Data parallel on the CPU: tokens per second of 2 gloo ranks against 1, and the checkpoint stall.

Two workloads, both ``examples/tiny-lm.sx --set dim=256 --set layers=4``
(3.17M parameters): the example's own global batch of 32 records (512 tokens a
step), and the same model with a global batch of 256 (4096 tokens a step), a
copy of the file in a temporary folder with only ``:batch`` changed. Each is
trained through ``sexpgpu run``, on one rank with one thread and with
``--devices 2`` (two ranks, one thread each) under ``--shard none``,
``--shard optimizer`` and ``--shard full``, alternating, ``--repeats`` times.
Throughput comes from the run's own metrics: the global ``tokens`` counter over
the wall time between the ``--skip``-th step and the last, so start-up
(imports, rendezvous) is left out. The stall is each checkpoint annotation's
``blocked`` (the time the step loop waited for the host copy; with several
ranks, rank 0's wait is every rank's, since the next all-reduce waits for it).
Prints the median, fastest and slowest of each and the ratio of the medians
(goal: >= 1.6), and a 2-rank step taken apart: its forward and backward passes
on half the batch (measured, two processes at once), the update (measured on
the whole model in one process; half of it under ``optimizer`` and ``full``), and the rest,
mostly the gradients' exchange that the backward pass did not hide (derived).

Two more figures say what bounds the ratio on this machine:

- the **ceiling**: one process stepping the whole batch (forward, backward,
  optimizer update; no group, no communication) against two independent
  processes each stepping half of it at the same time. Their ratio is the most
  any data parallel could give here: two cores share one memory system, and a
  small step is mostly element-wise passes over memory, which do not get twice
  as fast with two cores (matrix products do);
- the **all-reduce** of one step's gradients (the model's size in f32) between
  two gloo ranks through ``torchrun``.

Take the figures with nothing else running: a loaded machine says more about
its other work than about the ranks.

    python benchmarks/bench_data_parallel.py [--repeats 3] [--workload example|large|both]

Figures from an idle 2-core machine: docs/distributed.md, "Speed".
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

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "examples" / "tiny-lm.sx"
MODEL = ["--set", "dim=256", "--set", "layers=4"]
EXAMPLE_BATCH = ":batch 32"

# name: (global batch, steps, warm-up steps left out, checkpoint every)
WORKLOADS = {"example": (32, 40, 5, 10), "large": (256, 16, 3, 5)}


def program_with_batch(folder: Path, batch: int) -> Path:
    """tiny-lm.sx as it is, or a copy in ``folder`` whose global batch is ``batch``."""
    source = PROGRAM.read_text()
    if f":batch {batch}" == EXAMPLE_BATCH:
        return PROGRAM
    if source.count(EXAMPLE_BATCH) != 1:
        raise SystemExit(f"{PROGRAM} no longer says {EXAMPLE_BATCH!r} once; update this benchmark")
    path = folder / f"tiny-lm-batch{batch}.sx"
    path.write_text(source.replace(EXAMPLE_BATCH, f":batch {batch}"))
    return path


def one_run(
    program: Path, folder: Path, devices: int, steps: int, every: int, skip: int, shard: str
) -> tuple[float, list]:
    """Tokens per second after ``skip`` steps, and every checkpoint's ``blocked`` seconds."""
    args = [sys.executable, "-m", "sexpgpu_cli", "run", str(program), *MODEL]
    args += ["--set", f"checkpoint-every={every}"]
    args += ["--steps", str(steps), "--metrics-dir", str(folder / "m")]
    args += ["--checkpoint-dir", str(folder / "ckpt"), "--threads", "1"]
    if devices > 1:
        args += ["--devices", str(devices), "--shard", shard]
    env = dict(os.environ, OMP_NUM_THREADS="1", SEXPGPU_LOG_FORMAT="json")
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"sexpgpu run failed ({result.returncode}):\n{result.stderr[-2000:]}")
    (run_dir,) = (folder / "m").iterdir()
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.strip()]
    tokens = {e["step"]: (e["time"], e["value"]) for e in events if e.get("name") == "tokens"}
    (t0, n0), (t1, n1) = tokens[skip], tokens[steps]
    blocked = [e["blocked"] for e in events if "blocked" in e]
    return (n1 - n0) / (t1 - t0), blocked


def allreduce_ms(elements: int) -> float:
    """Milliseconds of one all-reduce of ``elements`` f32 between two gloo ranks."""
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    args += ["--nproc-per-node", "2", __file__, "--allreduce-worker", str(elements)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    times = [
        float(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("ms ")
    ]
    if not times:
        raise SystemExit(f"the all-reduce timing failed:\n{result.stderr[-2000:]}")
    return times[0]


def allreduce_worker(elements: int, repeats: int = 20) -> None:
    """One rank of :func:`allreduce_ms` (under torchrun)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    grads = torch.ones(elements)
    for _ in range(3):
        dist.all_reduce(grads)
    started = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(grads)
    if dist.get_rank() == 0:
        print(f"ms {(time.perf_counter() - started) / repeats * 1000:.3f}", flush=True)
    dist.destroy_process_group()


def step_worker(program: Path, part: int, parts: int, steps: int) -> None:
    """Print the milliseconds of a step (propose, finite guard, commit; no group) on part ``part``
    of ``parts`` of the global batch, on one thread: one process of the ceiling."""
    import torch

    from sexpgpu.catalog import Catalog
    from sexpgpu.choices import Choices
    from sexpgpu.session import Selection, lower, open_loader

    torch.set_num_threads(1)
    catalog = Catalog.load()
    program_ = Selection(str(program), sets={"dim": "256", "layers": "4"}).compile(catalog)
    trainer = lower(program_, catalog, device="cpu", choices=Choices()).trainer
    trainer.init_params()
    batch = open_loader(catalog, program_.stages[0].data, 1)[1].next_batch()
    share = len(next(iter(batch.values()))) // parts
    mine = {name: array[part * share : (part + 1) * share] for name, array in batch.items()}
    backward = 0.0
    for step in range(1, steps + 1):
        if step == 3:  # the first steps allocate; leave them out
            started, backward = time.perf_counter(), 0.0
        proposal = trainer.propose(mine, stage=0, step=step, lr=1e-3)
        trainer.find_non_finite(proposal)  # the run's finite guard, as a step of the run
        trainer.commit(proposal)
        # the forward and backward passes alone, once more on the same batch (the
        # trainer's own function: what a step runs before its optimizer)
        trainer._inputs(mine, trainer.fields[0])
        trainer.ctx.training = True
        begun = time.perf_counter()
        trainer._loss_and_grads(0)
        backward += time.perf_counter() - begun
    took = time.perf_counter() - started - backward
    print(f"ms {took / (steps - 2) * 1000:.3f} {backward / (steps - 2) * 1000:.3f}", flush=True)


def ceiling(program: Path, steps: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Milliseconds of a step, and of its forward and backward passes, on the whole
    batch in one process, and in the slower of two processes stepping half of it
    each at the same time."""

    def start(part: int, parts: int) -> subprocess.Popen:
        args = [sys.executable, __file__, "--step-worker", str(program)]
        args += ["--part", f"{part}/{parts}", "--steps", str(steps)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True)

    def read(process: subprocess.Popen) -> tuple[float, float]:
        out, _ = process.communicate(timeout=1800)
        if process.returncode != 0:
            raise SystemExit("a ceiling worker failed")
        step, passes = out.split()[-2:]
        return float(step), float(passes)

    whole = read(start(0, 1))
    halves = [start(0, 2), start(1, 2)]
    return whole, max(read(process) for process in halves)


def parameters(folder: Path) -> int:
    """How many numbers a run's checkpoint holds as parameters (the gradients' size)."""
    from safetensors.numpy import load_file

    step = sorted((folder / "ckpt").iterdir())[-1]
    return sum(a.size for a in load_file(str(step / "params.safetensors")).values())


def summary(values: list[float]) -> str:
    return (
        f"median {statistics.median(values):.4g}  fastest-to-slowest "
        f"{min(values):.4g}..{max(values):.4g}  (n={len(values)})"
    )


def measure(name: str, root: Path, repeats: int) -> int:
    """Every figure of one workload, printed; returns the parameter count."""
    batch, steps, skip, every = WORKLOADS[name]
    program = program_with_batch(root, batch)
    configs = [(1, "none"), (2, "none"), (2, "optimizer"), (2, "full")]
    rates: dict[tuple, list[float]] = {c: [] for c in configs}
    stalls: dict[tuple, list[float]] = {c: [] for c in configs}
    elements = 0
    for repeat in range(repeats):
        for devices, shard in configs:
            folder = root / f"{name}-{devices}-{shard}-{repeat}"
            rate, blocked = one_run(program, folder, devices, steps, every, skip, shard)
            rates[devices, shard].append(rate)
            stalls[devices, shard].extend(blocked)
            elements = parameters(folder)
            print(f"{name} run {repeat} devices={devices} shard={shard}: {rate:.0f} tokens/s")
    label = f"{name} (global batch {batch}, {batch * 16} tokens/step)"
    for devices, shard in configs:
        what = f"{devices} rank(s) x 1 thread, shard {shard}"
        print(f"{label} {what}  tokens/s  {summary(rates[devices, shard])}")
        print(f"{label} {what}  stall s   {summary(stalls[devices, shard])}")
    (whole_ms, whole_passes), (half_ms, half_passes) = ceiling(
        program, steps=8 if batch > 64 else 20
    )
    one = statistics.median(rates[1, "none"])
    for devices, shard in configs[1:]:
        rate = statistics.median(rates[devices, shard])
        ratio = rate / one
        stall = statistics.median(stalls[devices, shard]) / statistics.median(stalls[1, "none"])
        print(f"{label} shard {shard}: 2 ranks / 1 rank (medians): {ratio:.2f}  (goal >= 1.6)")
        print(f"{label} shard {shard}: checkpoint stall ratio 2 ranks / 1 rank: {stall:.2f}")
        # a 2-rank step: its half-batch passes (two at once), the update (the whole
        # model's, or half of it when each rank updates what it owns), and the rest,
        # mostly the gradients' exchange not hidden behind the backward pass
        step_ms = batch * 16 / rate * 1000
        update = whole_ms - whole_passes
        update = update / 2 if shard in ("optimizer", "full") else update
        rest = step_ms - half_passes - update
        print(
            f"{label} shard {shard}: a step {step_ms:.1f} ms = passes {half_passes:.1f} + "
            f"update ~{update:.1f} + exchange and the rest ~{rest:.1f} (derived)"
        )
    print(
        f"{label} ceiling: a step on the whole batch {whole_ms:.1f} ms in one process "
        f"(passes {whole_passes:.1f}), {half_ms:.1f} ms on half in each of two at once "
        f"(passes {half_passes:.1f}): at most {whole_ms / half_ms:.2f}x",
        flush=True,
    )
    return elements


def main() -> None:
    """Measure the workloads, alternating set-ups, and print one line per figure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    parser.add_argument("--allreduce-worker", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--step-worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--part", default="0/1", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=20, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.allreduce_worker:
        allreduce_worker(args.allreduce_worker)
        return
    if args.step_worker:
        part, parts = (int(x) for x in args.part.split("/"))
        step_worker(Path(args.step_worker), part, parts, args.steps)
        return
    names = list(WORKLOADS) if args.workload == "both" else [args.workload]
    with tempfile.TemporaryDirectory(prefix="sexpgpu-bench-dp-") as root:
        for name in names:
            elements = measure(name, Path(root), args.repeats)
    print(
        f"all-reduce of {elements} f32 (one step's gradients) between 2 gloo ranks: "
        f"{allreduce_ms(elements):.1f} ms"
    )


if __name__ == "__main__":
    main()
