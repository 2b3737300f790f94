"""examples/distill.sx: a student trained against a frozen with-loaded teacher, which
examples/make_teacher.sh makes from a run's checkpoint, learns more than without it;
examples/onpolicy-distill.sx: a student that samples, scored token by token by that
teacher (docs/generate.md), writes what the teacher finds likelier."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def taught(tmp_path_factory) -> Path:
    """A user's folder with the examples and the teacher make_teacher.sh made."""
    work = tmp_path_factory.mktemp("distill")
    shutil.copytree(EXAMPLES, work / "examples", ignore=shutil.ignore_patterns("sexpgpu-runs"))
    (work / "examples" / "teacher.safetensors").unlink(missing_ok=True)
    made = subprocess.run(
        ["sh", "examples/make_teacher.sh"],
        cwd=work,
        env=sexpgpu_env(SEXPGPU=str(Path(sys.executable).with_name("sexpgpu"))),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    assert (work / "examples" / "teacher.safetensors").stat().st_size > 0
    return work


def test_the_student_learns_more_with_its_teacher(taught: Path) -> None:
    tmp_path = taught
    with_teacher = probed_loss(tmp_path, "1")
    without = probed_loss(tmp_path, "0")
    assert with_teacher < without - 0.03, (with_teacher, without)
    # the teacher is named by the student's checkpoint, not copied into it
    step = tmp_path / "ckpt-1" / f"step-{TRAIN:08d}"
    pinned = json.loads((step / "experiment.json").read_text())["params"]
    assert [p["load"]["tensor"] for p in pinned if "load" in p] == ["model.embed", "model.head"]


def test_a_student_sampling_its_own_bytes_comes_to_write_what_the_teacher_would(
    taught: Path,
) -> None:
    metrics = taught / "metrics-onpolicy"
    result = run_sexpgpu(
        "run",
        "examples/onpolicy-distill.sx",
        *("--checkpoint-dir", taught / "ckpt-onpolicy", "--metrics-dir", metrics),
        cwd=taught,
    )
    assert result.returncode == 0, result.stderr
    (events,) = metrics.rglob("events.jsonl")
    points = [e for e in map(json.loads, events.read_text().splitlines()) if e["kind"] == "point"]
    score = {e["step"]: e["value"] for e in points if e["name"] == "taught/teacher-logp"}
    assert sorted(score) == [10, 20, 30, 40, 50, 60]
    # the teacher's mean log-probability of the bytes the student writes rises
    assert score[60] > score[10] + 2.0, score
    kl = {e["step"]: e["value"] for e in points if e["name"] == "loss"}
    assert sum(kl[s] for s in range(51, 61)) < sum(kl[s] for s in range(1, 11)) / 2, kl
    made = {e["step"]: e["value"] for e in points if e["name"] == "generated"}
    assert made[60] == 60 * 8 * 2 * 16  # every record writes its 16 bytes (no stop token)
