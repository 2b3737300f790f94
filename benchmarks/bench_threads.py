"""The price of pinning a run's CPU thread count: steps per second of tiny-lm
(``dim=256 layers=4`` by default) pinned to 1 thread against free (torch's
default: the cores this process may use), each in its own ``sexpgpu run``.

    .venv/bin/python benchmarks/bench_threads.py [--steps 10] [--rounds 5] [--pinned 1]

A run checkpointed on a 1-core machine and resumed on a bigger one keeps 1
thread (docs/determinism.md), so this is what moving such a run costs against
choosing again with ``--choices fresh``. The two sides alternate round by round,
so both see the same machine load; prints each side's median steps per second
with its spread (min-max) and the ratio. The seconds are the run's own
(``run finished``: the steps, not the start-up).
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


def _without_evals(folder: Path) -> Path:
    """tiny-lm without its eval pass, so the seconds are training steps only."""
    text = re.sub(r"\n\s*:evals .*\)\)\)", ")", EXAMPLE.read_text())
    path = folder / "tiny-lm-bench.sx"
    path.write_text(text)
    return path


def steps_per_second(file: Path, folder: Path, steps: int, knobs: list[str], threads: int | None):
    """One ``sexpgpu run`` of ``steps`` steps: (steps per second, thread count it took)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["SEXPGPU_LOG_FORMAT"] = "json"
    pin = ["--threads", str(threads)] if threads else []
    sets = [arg for knob in knobs for arg in ("--set", knob)]
    args = [*SEXPGPU, "run", str(file), "--steps", str(steps), *sets, *pin]
    args += ["--metrics-dir", str(folder / "m"), "--log-every", str(steps)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    lines = [json.loads(ln) for ln in done.stderr.splitlines() if ln.startswith("{")]
    finished = next((ln for ln in lines if ln.get("event") == "run finished"), None)
    started = next((ln for ln in lines if ln.get("event") == "run started"), {})
    if done.returncode != 0 or finished is None:
        raise SystemExit(f"sexpgpu run failed ({done.returncode}):\n{done.stderr[-2000:]}")
    took = started.get("choices", {}).get("cpu.threads", "?")
    return finished["steps_run"] / finished["seconds"], took


def main() -> None:
    """Parse the arguments, run the rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pinned", type=int, default=1, help="the pinned thread count")
    parser.add_argument("--set", dest="knobs", action="append", default=None)
    options = parser.parse_args()
    knobs = options.knobs or ["dim=256", "layers=4"]
    results: dict[str, list[float]] = {"pinned": [], "free": []}
    took: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        file = _without_evals(folder)
        for _ in range(options.rounds):
            for side, threads in (("pinned", options.pinned), ("free", None)):
                rate, took[side] = steps_per_second(file, folder, options.steps, knobs, threads)
                results[side].append(rate)
    print(f"tiny-lm {' '.join(knobs)}, {options.steps} steps x {options.rounds} rounds")
    for side, rates in results.items():
        print(
            f"  {side:6} {took[side]:>2} threads  median {statistics.median(rates):7.2f} steps/s"
            f"  (min {min(rates):.2f}, max {max(rates):.2f})"
        )
    ratio = statistics.median(results["pinned"]) / statistics.median(results["free"])
    print(f"  pinned / free: {ratio:.2f}")


if __name__ == "__main__":
    main()
