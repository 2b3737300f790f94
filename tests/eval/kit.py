"""Helpers for the evaluation tests: a run, its points, and evaluate's points."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.helpers import events, experiments, run_sexpgpu

RUN = ["run", "eval.sx", "--checkpoint-dir", "ck", "--metrics-dir", "m"]


def train(workdir: Path, *extra: str) -> None:
    """Run eval.sx to its end, checkpointing to ``ck`` and reporting to ``m``."""
    result = run_sexpgpu(*RUN, *extra, cwd=workdir)
    assert result.returncode == 0, result.stderr


def the_run(workdir: Path) -> Path:
    """The one metrics experiment under ``m``."""
    (run_dir,) = experiments(workdir / "m")
    return run_dir


def eval_points(workdir: Path, *, source: str | None) -> dict[tuple[int, str], list[float]]:
    """(step, pass/metric) -> values of the eval points from ``source`` (``None``: the run)."""
    found: dict[tuple[int, str], list[float]] = {}
    for event in events(the_run(workdir)):
        if event["kind"] != "point" or "/" not in event["name"]:
            continue
        if event.get("source") == source:
            found.setdefault((event["step"], event["name"]), []).append(event["value"])
    return found


def evaluated(checkpoint_dir: Path) -> dict:
    return json.loads((checkpoint_dir / "evaluated.json").read_text())


def one_line(stderr: str) -> str:
    """The last line of stderr, checked to be the only line that is not a JSON log record."""
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("{")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]
