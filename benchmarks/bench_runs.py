"""`sexpgpu runs` with hundreds of runs (goal: 500 runs listed in under 1 s).

Makes ``--runs`` synthetic runs in a temporary metrics folder, each a status file
and an ``events.jsonl`` as a run of ``--steps`` steps writes it (loss, lr, tokens
per step, an eval pass every 100 steps, a checkpoint annotation every 100; about
300 KB for 1000 steps), a fifth of them still running and one in ten resumed.
Then it times, ``--repeats`` times each, the listing in-process
(``list_runs``: the status files and the tails of the events) and the whole
command, ``sexpgpu runs --json`` in a new process (start-up included), and prints
each one's median, fastest and slowest. The files are in the page cache after
they are made: this is the listing's own cost, not the disk's.

    python benchmarks/bench_runs.py [--runs 500] [--steps 1000] [--repeats 7]
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
import uuid
from pathlib import Path


def _events(slug: str, steps: int, start: float) -> str:
    lines = []

    def add(step: int, kind: str, **fields: object) -> None:
        event = {"kind": kind, "id": uuid.uuid4().hex, "experiment": slug, "step": step,
                 "time": start + step * 0.05, **fields}  # fmt: skip
        lines.append(json.dumps(event, separators=(",", ":")))

    for step in range(1, steps + 1):
        add(step, "point", name="loss", value=3.0 / step**0.3)
        add(step, "point", name="lr", value=1e-3)
        add(step, "point", name="tokens", value=512 * step)
        if step % 100 == 0:
            add(step, "point", name="probe/loss", value=2.0 / step**0.3)
            add(step, "point", name="probe/accuracy", value=1 - 1 / step**0.3)
            add(step, "annotation", text=f"checkpoint ck/step-{step:08d}", seconds=0.01)
    return "\n".join(lines) + "\n"


def make_runs(root: Path, runs: int, steps: int) -> None:
    """``runs`` run folders under ``root``, as `sexpgpu run` leaves them."""
    now = time.time() - runs * 60
    for index in range(runs):
        slug = f"bench-{index:06x}"
        folder = root / slug
        folder.mkdir(parents=True)
        (folder / "events.jsonl").write_text(_events(slug, steps, now + index * 60))
        state = "running" if index % 5 == 0 else "finished"
        status = {
            "state": state, "summary": state, "error": None, "step": steps,
            "checkpoint": f"ck/step-{steps:08d}", "slug": slug, "updated": now + index * 60 + 50,
            "run": "bench", "file": "bench.sx", "steps": steps, "pid": 1_000_000 + index,
            "host": os.uname().nodename, "started": now + index * 60,
        }  # fmt: skip
        (folder / "status.json").write_text(json.dumps(status, indent=1))


def _spread(name: str, seconds: list[float], runs: int) -> None:
    print(
        f"{name}: {runs} runs, median {statistics.median(seconds):.3f} s, "
        f"fastest {min(seconds):.3f} s, slowest {max(seconds):.3f} s ({len(seconds)} repeats)"
    )


def main() -> None:
    """Make the runs, time the listing and the command, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    from sexpgpu_report.listing import list_runs

    with tempfile.TemporaryDirectory(prefix="bench-runs-") as tmp:
        root = Path(tmp) / "m"
        made = time.perf_counter()
        make_runs(root, args.runs, args.steps)
        size = sum(p.stat().st_size for p in root.rglob("*"))
        print(f"made {args.runs} runs ({size / 1e6:.0f} MB) in {time.perf_counter() - made:.1f} s")
        listing = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            rows = list_runs(root)
            listing.append(time.perf_counter() - start)
        assert len(rows) == args.runs and rows[0].loss is not None and rows[0].evals
        _spread("list_runs (in-process)", listing, args.runs)
        command = [sys.executable, "-m", "sexpgpu_cli", "runs", "--json", "--metrics-dir", root]
        whole = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = subprocess.run(command, capture_output=True, check=True).stdout
            whole.append(time.perf_counter() - start)
        assert len(json.loads(out)) == args.runs
        _spread("sexpgpu runs --json (new process)", whole, args.runs)


if __name__ == "__main__":
    main()
