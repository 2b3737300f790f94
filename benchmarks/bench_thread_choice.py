"""The thread count a new run chooses (sexpgpu_torch.threads) against each fixed count,
on an idle machine and beside one busy process.

    .venv/bin/python benchmarks/bench_thread_choice.py [--rounds 5] [--steps 60]

For each program (the README's example, tiny-lm, at several widths), each way of
running it (``chosen``: nothing set, the run chooses; ``--threads 1`` ... up to the
cores this process may use) is one ``sexpgpu run`` in its own process; the ways
alternate round by round so that all see the same machine. The figure is the
run's own steps per second (``run finished``: its steps, not its start-up). Then
the same beside a busy neighbour: one process spinning on a core for the whole
measurement. Prints, per condition and program, each way's median steps/s with its
spread (min-max), the count ``chosen`` took, and ``chosen`` against the best fixed
count (the goal: within 1.2x of it, that is a ratio of at least 0.83).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny-lm.sx"
SEXPGPU = [sys.executable, "-c", "from sexpgpu_cli.main import main; main()"]
PROGRAMS = {
    "tiny-lm (README)": [],
    "dim=64": ["dim=64"],
    "dim=128": ["dim=128"],
    "dim=256 layers=4": ["dim=256", "heads=8", "layers=4"],
}
STEPS_SCALE = {"tiny-lm (README)": 1.0, "dim=64": 1.0, "dim=128": 0.5, "dim=256 layers=4": 0.2}


def without_evals(folder: Path) -> Path:
    """tiny-lm without its eval pass, so the seconds are training steps only."""
    path = folder / "tiny-lm-bench.sx"
    path.write_text(re.sub(r"\n\s*:evals .*\)\)\)", ")", EXAMPLE.read_text()))
    return path


def one_run(file: Path, folder: Path, steps: int, knobs: list[str], threads: int | None):
    """One ``sexpgpu run``: (steps per second, the thread count it took)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_"))}
    env["SEXPGPU_LOG_FORMAT"] = "json"
    args = [*SEXPGPU, "run", str(file), "--steps", str(steps), "--log-every", str(steps)]
    args += [a for knob in knobs for a in ("--set", knob)]
    args += ["--metrics-dir", str(folder / "m")] + (["--threads", str(threads)] if threads else [])
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    lines = [json.loads(ln) for ln in done.stderr.splitlines() if ln.startswith("{")]
    finished = next((ln for ln in lines if ln.get("event") == "run finished"), None)
    started = next((ln for ln in lines if ln.get("event") == "run started"), {})
    if done.returncode != 0 or finished is None:
        raise SystemExit(f"sexpgpu run failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return finished["steps_run"] / finished["seconds"], started["choices"]["cpu.threads"]


def measure(file: Path, folder: Path, steps: int, rounds: int, counts: list[int]) -> dict:
    """{program: {way: ([steps/s per round], threads taken)}}, the ways interleaved."""
    results: dict[str, dict[str, tuple[list[float], str]]] = {}
    ways: list[int | None] = [None, *counts]
    for name, knobs in PROGRAMS.items():
        n = max(5, int(steps * STEPS_SCALE[name]))
        table = results.setdefault(name, {})
        one_run(file, folder, 2, knobs, None)  # warm the page cache and the bytecode
        for _ in range(rounds):
            for threads in ways:
                rate, took = one_run(file, folder, n, knobs, threads)
                label = "chosen" if threads is None else f"{threads} threads"
                table.setdefault(label, ([], took))[0].append(rate)
    return results


def report(condition: str, results: dict) -> None:
    print(f"\n{condition}")
    for name, table in results.items():
        medians = {way: statistics.median(rates) for way, (rates, _) in table.items()}
        best_way = max((w for w in medians if w != "chosen"), key=medians.__getitem__)
        print(f"  {name}")
        for way, (rates, took) in table.items():
            extra = f" (took {took})" if way == "chosen" else ""
            print(f"    {way:10} median {medians[way]:8.2f} steps/s  "
                  f"(min {min(rates):.2f}, max {max(rates):.2f}){extra}")  # fmt: skip
        ratio = medians["chosen"] / medians[best_way]
        print(f"    chosen / best ({best_way}): {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60, help="steps of the smallest program")
    options = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    counts = sorted({1, 2, cores} & set(range(1, cores + 1)))
    print(f"{cores} cores; {options.rounds} rounds; torch's default would take {cores}")
    with tempfile.TemporaryDirectory(prefix="sexpgpu-threads-") as scratch:
        folder = Path(scratch)
        file = without_evals(folder)
        report("idle", measure(file, folder, options.steps, options.rounds, counts))
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            results = measure(file, folder, options.steps, options.rounds, counts)
        finally:
            busy.kill()
            busy.wait()
        report("beside one busy process", results)


if __name__ == "__main__":
    main()
