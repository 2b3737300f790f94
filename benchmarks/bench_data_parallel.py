"""Data parallel on the CPU: tokens per second of 2 gloo ranks against 1, and the checkpoint stall.

Runs ``examples/tiny-lm.sx --set dim=256 --set layers=4`` (large enough that the
step's compute outweighs the gradient all-reduce) through ``sexpgpu run``, once
on one rank with one thread and once with ``--devices 2`` (two ranks, one thread
each), alternating, ``--repeats`` times. Throughput comes from the run's own
metrics: the global ``tokens`` counter over the wall time between the
``--skip``-th step and the last, so start-up (imports, rendezvous, compiling)
is left out. The stall is each checkpoint annotation's ``blocked`` (the time the
step loop waited for the host copy; with several ranks, rank 0's wait is every
rank's, since the next all-reduce waits for it). Prints the median, fastest and
slowest of each and the ratio of the medians (goal: >= 1.7 on two free cores).

On a machine other work keeps busy the ratio says more about that work than
about the ranks, so the all-reduce of one step's gradients (the model's size in
f32) is timed too, between two gloo ranks through ``torchrun``, with one step of
the model on the whole batch and on half of it, in this process on one thread;
``full / (half + all-reduce)`` is what two free cores would give, printed beside
the measured ratio. (Each rank still runs the whole optimizer update: a fixed
cost the ranks do not share.)

    python benchmarks/bench_data_parallel.py [--steps 40] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "examples" / "tiny-lm.sx"


def one_run(folder: Path, devices: int, steps: int, every: int, skip: int) -> tuple[float, list]:
    """Tokens per second after ``skip`` steps, and every checkpoint's ``blocked`` seconds."""
    args = [sys.executable, "-m", "sexpgpu_cli", "run", str(PROGRAM)]
    args += ["--set", "dim=256", "--set", "layers=4", "--set", f"checkpoint-every={every}"]
    args += ["--steps", str(steps), "--metrics-dir", str(folder / "m")]
    args += ["--checkpoint-dir", str(folder / "ckpt"), "--threads", "1"]
    if devices > 1:
        args += ["--devices", str(devices)]
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


def allreduce_ms(elements: int, repeats: int = 20) -> float:
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
    import time

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


def step_ms(repeats: int = 10) -> tuple[float, float]:
    """Milliseconds of one training step on the whole global batch and on half of it."""
    import time

    import torch

    from sexpgpu.lang import compile_file
    from sexpgpu.run import lower_program, open_data

    torch.set_num_threads(1)
    program = compile_file(str(PROGRAM), sets={"dim": "256", "layers": "4"})
    trainer = lower_program(program)
    trainer.init_params()
    batch = open_data(program.stages[0].data, 1)[1].next_batch()
    half = {name: array[: len(array) // 2] for name, array in batch.items()}
    times = []
    for part in (batch, half):
        for _ in range(3):
            trainer.propose(part, stage=0, step=1, lr=1e-3)
        started = time.perf_counter()
        for _ in range(repeats):
            trainer.propose(part, stage=0, step=1, lr=1e-3)
        times.append((time.perf_counter() - started) / repeats * 1000)
    return times[0], times[1]


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


def main() -> None:
    """Measure both set-ups, alternating, and print one line per figure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--skip", type=int, default=5, help="steps left out as warm-up")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--allreduce-worker", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.allreduce_worker:
        allreduce_worker(args.allreduce_worker)
        return

    rates: dict[int, list[float]] = {1: [], 2: []}
    stalls: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="sexpgpu-bench-dp-") as root:
        for repeat in range(args.repeats):
            for devices in (1, 2):
                folder = Path(root) / f"{devices}-{repeat}"
                rate, blocked = one_run(folder, devices, args.steps, args.every, args.skip)
                rates[devices].append(rate)
                elements = parameters(folder)
                stalls[devices].extend(blocked)
                print(f"run {repeat} devices={devices}: {rate:.0f} tokens/s", flush=True)
    for devices in (1, 2):
        print(f"{devices} rank(s) x 1 thread  tokens/s   {summary(rates[devices])}")
        print(f"{devices} rank(s) x 1 thread  stall s    {summary(stalls[devices])}")
    ratio = statistics.median(rates[2]) / statistics.median(rates[1])
    print(f"throughput ratio 2 ranks / 1 rank (medians): {ratio:.2f}  (goal >= 1.7)")
    stall = statistics.median(stalls[2]) / statistics.median(stalls[1])
    print(f"checkpoint stall ratio 2 ranks / 1 rank (medians): {stall:.2f}")
    reduce_ms = allreduce_ms(elements)
    full_ms, half_ms = step_ms()
    projected = full_ms / (half_ms + reduce_ms)
    print(
        f"all-reduce of {elements} f32 between 2 gloo ranks: {reduce_ms:.1f} ms; a step on "
        f"the whole batch {full_ms:.1f} ms, on half {half_ms:.1f} ms; on two free cores "
        f"2 ranks would give {projected:.2f}x"
    )


if __name__ == "__main__":
    main()
