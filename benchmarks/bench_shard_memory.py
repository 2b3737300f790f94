"""Peak memory per rank for each sharding, on the CPU, with a model of 50M parameters.

``examples/tiny-lm.sx --set dim=1024 --set layers=4`` (50.4M parameters: 202 MB of
f32, adamw's two states 403 MB more) trains ``--steps`` steps through
``sexpgpu run``, checkpointing the last: on one rank, then on two gloo ranks with ``--shard none``,
``--shard optimizer`` and ``--shard full``. Each is started from a fresh Python process that
reads, once its ``sexpgpu`` has exited, the largest resident set any of its
descendants reached (``getrusage(RUSAGE_CHILDREN).ru_maxrss``: the launcher's
workers are waited for, so the largest worker's peak). A 1-parameter run of the
same program (``dim=8 layers=1``) gives the footprint of the process itself
(Python, torch, the launcher's worker), subtracted to leave what the
parameters, gradients, optimizer states and their proposals take.

Each run is measured twice: with glibc's allocator as it comes, which keeps
much of what a process frees for its next allocations (the resident set then
holds memory no tensor uses), and with ``MALLOC_MMAP_THRESHOLD_=65536``, which
gives every block of 64 KB or more back to the system as it is freed: the
memory the tensors really hold at their peak.

    python benchmarks/bench_shard_memory.py [--repeats 1] [--steps 3]

Nothing else should run: memory is not noisy the way time is, but a loaded
machine makes the runs slow.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "examples" / "tiny-lm.sx"
LARGE = ["--set", "dim=1024", "--set", "layers=4"]
SMALL = ["--set", "dim=8", "--set", "layers=1", "--set", "heads=1"]
CONFIGS = [("1 rank", []), ("2 ranks, none", ["--devices", "2", "--shard", "none"])]
CONFIGS += [("2 ranks, optimizer", ["--devices", "2", "--shard", "optimizer"])]
CONFIGS += [("2 ranks, full", ["--devices", "2", "--shard", "full"])]


RETURNING = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc gives every freed block of 64 KB or more back at once (see the docstring)."""


def peak_mb(args: list[str], env: dict[str, str] | None = None) -> float:
    """The largest resident set (MB) of any process ``sexpgpu run ARGS`` started,
    measured from a fresh Python process so no earlier run counts."""
    code = (
        "import resource, subprocess, sys, json\n"
        "r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "assert r.returncode == 0, r.stderr[-2000:]\n"
        "print(json.dumps(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
    )
    command = [sys.executable, "-c", code, sys.executable, "-m", "sexpgpu_cli", "run", *args]
    out = subprocess.run(
        command, capture_output=True, text=True, check=True, env={**os.environ, **(env or {})}
    ).stdout
    return json.loads(out.strip().splitlines()[-1]) / 1024  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        common = [str(PROGRAM), "--steps", str(options.steps), "--metrics-dir", folder]
        common += ["--threads", "1"]
        for label, env in (("glibc as it comes", None), ("freed blocks returned", RETURNING)):
            print(f"-- {label}")
            results = {}
            for index, (name, extra) in enumerate(CONFIGS):
                # a checkpoint of the last step, as a run takes: its host copies count too
                where = ["--checkpoint-dir", f"{folder}/ckpt-{label[0]}{index}"]
                small = [*common, *SMALL, *extra]
                large = [*common, *LARGE, *extra, *where]
                base = min(peak_mb(small, env) for _ in range(options.repeats))
                full = min(peak_mb(large, env) for _ in range(options.repeats))
                results[name] = (full, base)
                print(
                    f"{name:20s} peak {full:7.0f} MB   footprint {base:5.0f} MB   "
                    f"model's {full - base:7.0f} MB"
                )
            one = results["1 rank"][0] - results["1 rank"][1]
            for name, (full, base) in results.items():
                print(f"{name:20s} model's memory / one rank's: {(full - base) / one:.2f}")


if __name__ == "__main__":
    main()
