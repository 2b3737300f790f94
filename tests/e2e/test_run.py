"""`sexpgpu run` end to end: metrics, status, checkpoints, resume latest."""

from __future__ import annotations

import json

from tests.e2e.helpers import refused_in_process

from .helpers import (
    assert_every_checkpoint_complete,
    events,
    experiments,
    run_sexpgpu,
    status,
    step_dirs,
)


def test_my_run_trains_and_checkpoints(workdir):
    result = run_sexpgpu(
        "run", "examples/my-run.sx", "--checkpoint-dir", "ckpt", "--metrics-dir", "m", cwd=workdir
    )
    assert result.returncode == 0, result.stderr
    (run_dir,) = experiments(workdir / "m")
    assert run_dir.name.startswith("my-run-")
    stream = events(run_dir)
    losses = [e for e in stream if e["kind"] == "point" and e["name"] == "loss"]
    assert [e["step"] for e in losses] == [1, 2, 3, 4]
    assert {e["name"] for e in stream if e["kind"] == "point"} >= {"loss", "lr", "tokens"}
    assert len({e["id"] for e in stream}) == len(stream)
    assert stream[-1]["kind"] == "done"
    annotations = [e for e in stream if e["kind"] == "annotation"]
    texts = [a["text"] for a in annotations]
    assert texts[0].startswith("checkpoint ") and texts[0].endswith("ckpt/step-00000002")
    assert texts[1].startswith("checkpoint ") and texts[1].endswith("ckpt/step-00000004")
    assert all(a["seconds"] >= 0 for a in annotations)
    assert [a["step"] for a in annotations] == [2, 4]
    # every :checkpoint-every steps and after the last, not twice when they coincide
    assert step_dirs(workdir / "ckpt") == ["step-00000002", "step-00000004"]
    assert_every_checkpoint_complete(workdir / "ckpt")
    final = json.loads((workdir / "ckpt" / "step-00000004" / "experiment.json").read_text())
    first = json.loads((workdir / "ckpt" / "step-00000002" / "experiment.json").read_text())
    assert final["finished"] is True and first["finished"] is False
    assert final["slug"] == run_dir.name
    st = status(run_dir)
    assert st["state"] == "finished" and st["step"] == 4
    assert st["checkpoint"].endswith("step-00000004")


def test_without_location_nothing_is_written(workdir):
    result = run_sexpgpu("run", "examples/my-run.sx", "--metrics-dir", "m", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert not (workdir / "ckpt").exists()
    (run_dir,) = experiments(workdir / "m")
    assert status(run_dir)["checkpoint"] is None


def test_resume_latest_starts_restarts_and_continues(workdir):
    args = [
        "run",
        "examples/my-run.sx",
        "--checkpoint-dir",
        "ckpt",
        "--metrics-dir",
        "m",
        "--resume",
        "latest",
    ]
    first = run_sexpgpu(*args, "--steps", "2", cwd=workdir)
    assert first.returncode == 0, first.stderr
    second = run_sexpgpu(*args, cwd=workdir)
    assert second.returncode == 0, second.stderr
    (run_dir,) = experiments(workdir / "m")  # the same experiment
    stream = events(run_dir)
    resumed = [
        e for e in stream if e["kind"] == "annotation" and e["text"].startswith("resumed from")
    ]
    assert len(resumed) == 1
    lines = resumed[0]["text"].split("\n")
    assert lines[0].startswith("resumed from ") and lines[0].endswith("ckpt/step-00000002")
    assert lines[1:] == ["knob steps 2 -> 4"]
    assert [e["step"] for e in stream if e["kind"] == "point" and e["name"] == "loss"] == [
        1,
        2,
        3,
        4,
    ]
    assert step_dirs(workdir / "ckpt") == ["step-00000002", "step-00000004"]


def test_resume_latest_needs_a_location(workdir):
    result = refused_in_process(
        "run", "examples/my-run.sx", "--resume", "latest", "--metrics-dir", "m", cwd=workdir
    )
    assert result.returncode != 0
    said = [line for line in result.stderr.splitlines() if not line.startswith("{")]  # not logs
    assert len(said) == 1 and "checkpoint location" in said[0], result.stderr
    assert "Traceback" not in result.stderr


def test_resume_of_a_missing_checkpoint_is_an_error(workdir):
    result = refused_in_process(
        "run",
        "examples/my-run.sx",
        "--resume",
        "nowhere/step-00000002",
        "--metrics-dir",
        "m",
        cwd=workdir,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "nowhere/step-00000002" in result.stderr
    assert not (workdir / "m").exists() or not experiments(workdir / "m")
