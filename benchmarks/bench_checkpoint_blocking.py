"""How long a checkpoint blocks the step loop, against how long it takes to store.

Runs `sexpgpu run examples/tiny-lm.sx` widened to a ~200 MB checkpoint (parameters
plus two Adam states) with a checkpoint every 2 steps, and reads each checkpoint
annotation: `seconds` (first tensor leaving the device to the last byte stored)
and `blocked` (the part the loop waited for: the host copy). Also the median
step time, to compare against.

    python benchmarks/bench_checkpoint_blocking.py [--dim 768] [--steps 8]
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

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable, "-c", "from sexpgpu_cli.main import main; main()",
            "run", str(REPO / "examples" / "tiny-lm.sx"),
            "--set", f"dim={args.dim}", "--set", "checkpoint-every=2", "--steps", str(args.steps),
            "--checkpoint-dir", f"{tmp}/ckpt", "--metrics-dir", f"{tmp}/m",
        ]  # fmt: skip
        subprocess.run(
            command,
            check=True,
            capture_output=True,
            env={**os.environ, "SEXPGPU_LOG_FORMAT": "json"},
        )
        (run_dir,) = Path(tmp, "m").iterdir()
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        size = sum(f.stat().st_size for f in Path(tmp, "ckpt", f"step-{args.steps:08d}").iterdir())
    times = [e["time"] for e in events if e["kind"] == "point" and e["name"] == "loss"]
    step_time = statistics.median(b - a for a, b in zip(times, times[1:], strict=False))
    checkpoints = [
        e for e in events if e["kind"] == "annotation" and e["text"].startswith("checkpoint")
    ]
    print(f"checkpoint size: {size / 1e6:.1f} MB; median step {step_time * 1e3:.1f} ms")
    for c in checkpoints:
        print(
            f"step {c['step']:>3}: stored in {c['seconds']:.3f} s, loop blocked {c['blocked'] * 1e3:.1f} ms "
            f"({c['blocked'] / c['seconds']:.1%} of the write)"
        )


if __name__ == "__main__":
    main()
