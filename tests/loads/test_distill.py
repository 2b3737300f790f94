"""examples/distill.sx: a student trained against a frozen with-loaded teacher, which
examples/make_teacher.sh makes from a run's checkpoint, learns more than without it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.e2e.helpers import EXAMPLES

from .helpers import run_sexpgpu, sexpgpu_env

TRAIN, PROBE = 40, 32


def probed_loss(work: Path, teach: str) -> float:
    """The student's mean cross-entropy over PROBE batches after TRAIN steps with the
    teacher weighted ``teach``: the run is resumed with the teacher off and lr 0, so
    its step losses are the student's cross-entropy on batches it never trained on."""
    ckpt, metrics = work / f"ckpt-{teach}", work / f"metrics-{teach}"
    common = ["--checkpoint-dir", ckpt, "--metrics-dir", metrics]
    trained = run_sexpgpu(
        "run", "examples/distill.sx", "--set", f"teach={teach}", *common, cwd=work
    )
    assert trained.returncode == 0, trained.stderr
    probe = run_sexpgpu(
        "run",
        "examples/distill.sx",
        *("--set", "teach=0", "--set", "lr=0", "--steps", str(TRAIN + PROBE)),
        *common,
        "--resume",
        "latest",
        cwd=work,
    )
    assert probe.returncode == 0, probe.stderr
    (events,) = metrics.rglob("events.jsonl")
    losses = {
        e["step"]: e["value"]
        for e in map(json.loads, events.read_text().splitlines())
        if e.get("kind") == "point" and e.get("name") == "loss" and e["step"] > TRAIN
    }
    assert sorted(losses) == list(range(TRAIN + 1, TRAIN + PROBE + 1))
    return sum(losses.values()) / PROBE


def test_the_student_learns_more_with_its_teacher(tmp_path: Path) -> None:
    shutil.copytree(EXAMPLES, tmp_path / "examples", ignore=shutil.ignore_patterns("sexpgpu-runs"))
    (tmp_path / "examples" / "teacher.safetensors").unlink(missing_ok=True)
    made = subprocess.run(
        ["sh", "examples/make_teacher.sh"],
        cwd=tmp_path,
        env=sexpgpu_env(SEXPGPU=str(Path(sys.executable).with_name("sexpgpu"))),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "examples" / "teacher.safetensors").stat().st_size > 0
    with_teacher = probed_loss(tmp_path, "1")
    without = probed_loss(tmp_path, "0")
    assert with_teacher < without - 0.03, (with_teacher, without)
    # the teacher is named by the student's checkpoint, not copied into it
    step = tmp_path / "ckpt-1" / f"step-{TRAIN:08d}"
    pinned = json.loads((step / "experiment.json").read_text())["params"]
    assert [p["load"]["tensor"] for p in pinned if "load" in p] == ["model.embed", "model.head"]
