"""The status file: its fields, its states, atomic rewrites, throttled progress."""

from __future__ import annotations

import json
import threading
import time

import pytest

from sexpgpu.status import STATES, STATUS_FILE, StatusFile


def status_path(metrics_dir, slug):
    return metrics_dir / slug / STATUS_FILE


def read_status(path):
    return json.loads(path.read_text(encoding="utf-8"))


KEYS = {"state", "summary", "error", "step", "checkpoint", "slug", "updated"}


def test_the_lifecycle_of_a_run(tmp_path):
    path = status_path(tmp_path, "my-run-3f9a1c")
    assert path == tmp_path / "my-run-3f9a1c" / "status.json"
    status = StatusFile(path)

    before = time.time()
    assert status.update(state="running", step=0)
    first = read_status(path)
    assert set(first) == KEYS
    assert first["state"] == "running" and first["summary"] == "running"
    assert first["slug"] == "my-run-3f9a1c"  # the folder's name, by default
    assert first["checkpoint"] is None and first["error"] is None and first["step"] == 0
    assert before <= first["updated"] <= time.time()

    status.update(step=2, checkpoint="s3://b/runs/my-run/step-00000002")
    status.update(state="interrupted", step=3, checkpoint="s3://b/runs/my-run/step-00000003")
    interrupted = read_status(path)
    assert interrupted["state"] == "interrupted" and interrupted["summary"] == "interrupted"
    assert interrupted["step"] == 3
    assert interrupted["checkpoint"] == "s3://b/runs/my-run/step-00000003"


def test_failed_carries_the_error_and_the_summary(tmp_path):
    path = tmp_path / "exp" / "status.json"
    status = StatusFile(path)
    error = (
        "step 2: the proposed parameter of model.b has 1 values that are not finite; "
        "nothing was committed"
    )
    status.update(state="failed", step=1, error=error)
    data = json.loads(path.read_text())
    assert data["state"] == "failed"
    assert data["error"] == error
    assert data["summary"] == f"failed: {error}"
    # A resumed run that runs again clears the old error.
    status.update(state="running")
    data = read_status(path)
    assert data["error"] is None and data["summary"] == "running"


def test_an_unknown_state_is_refused_and_nothing_is_written(tmp_path):
    path = tmp_path / "exp" / "status.json"
    status = StatusFile(path)
    with pytest.raises(ValueError, match="unknown run state 'done'"):
        status.update(state="done")
    assert not path.exists()
    assert STATES == ("running", "interrupted", "finished", "failed")


def test_extra_fields_and_an_explicit_slug_are_kept(tmp_path):
    status = StatusFile(tmp_path / "folder" / "status.json")
    status.update(slug="my-run-000001", steps=6, tokens=1024)
    data = read_status(tmp_path / "folder" / "status.json")
    assert data["slug"] == "my-run-000001" and data["steps"] == 6 and data["tokens"] == 1024


def test_progress_writes_at_most_once_per_interval(tmp_path):
    path = tmp_path / "exp" / "status.json"
    status = StatusFile(path, min_interval=3600.0)
    assert status.progress(1) is True  # nothing written yet: write now
    assert status.progress(2) is False
    assert status.progress(3) is False
    assert read_status(path)["step"] == 1
    status.progress(4)
    status.update(state="finished")  # a state change is written at once, with the step
    data = read_status(path)
    assert data["state"] == "finished" and data["step"] == 4


def test_progress_writes_again_once_the_interval_has_passed(tmp_path):
    path = tmp_path / "exp" / "status.json"
    status = StatusFile(path, min_interval=0.0)
    for step in range(1, 4):
        assert status.progress(step)
        assert read_status(path)["step"] == step


def test_a_reader_never_sees_a_partial_file(tmp_path):
    path = tmp_path / "exp" / "status.json"
    status = StatusFile(path)
    status.update(state="running", step=0)
    stop = threading.Event()
    seen: list[int] = []
    problems: list[str] = []

    def reader():
        while not stop.is_set():
            try:
                data = read_status(path)
            except (OSError, ValueError) as exc:
                problems.append(repr(exc))
                continue
            if set(data) != KEYS | {"note"} and set(data) != KEYS:
                problems.append(f"keys {sorted(data)}")
            seen.append(data["step"])

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        # A long field makes each write big enough that a torn one would show.
        for step in range(1, 301):
            status.update(step=step, note="x" * 20000)
    finally:
        stop.set()
        thread.join()
    assert problems == []
    assert seen and seen == sorted(seen)  # never goes back
    assert read_status(path)["step"] == 300
    assert sorted(p.name for p in path.parent.iterdir()) == ["status.json"]  # no temp files left


def test_a_status_file_that_cannot_be_written_does_not_stop_the_run(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    status = StatusFile(blocker / "exp" / "status.json")
    assert status.update(state="running") is False
    assert status.progress(1) is False
    assert blocker.read_text() == ""


def test_writes_from_several_threads_all_land(tmp_path):
    # The step loop records steps while the checkpoint writer records checkpoints.
    status = StatusFile(tmp_path / "exp" / "status.json", min_interval=0.0)
    failed: list[bool] = []
    start = threading.Barrier(4)

    def loop(thread: int) -> None:
        start.wait()
        for i in range(200):
            if thread % 2:
                ok = status.update(checkpoint=f"ckpt/step-{thread}-{i}")
            else:
                ok = status.progress(i)
            if not ok:
                failed.append(True)

    threads = [threading.Thread(target=loop, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failed == []
    final = read_status(tmp_path / "exp" / "status.json")
    assert final["checkpoint"] in {"ckpt/step-1-199", "ckpt/step-3-199"}
    assert final["step"] == 199
    assert [p.name for p in (tmp_path / "exp").iterdir()] == ["status.json"]
