"""A metrics folder that fills up or stops taking the events file mid-run is reported: a
warning when it happens, and the undelivered events in the closing summary. The runs
are told to wait ``WAIT`` seconds for their sinks at the end (``--metrics-wait``),
not the default 30: the stop must come well before the default would end it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from .helpers import experiments, start_sexpgpu, wait_for_step

WAIT = 2  # seconds (--metrics-wait); the default is 30
RUN = ["run", "examples/my-run.sx", "--steps", "1000000", "--metrics-dir", "m",
       "--metrics-wait", str(WAIT)]  # fmt: skip


def swap_for_dev_full(run_dir):
    """The disk fills up: every write to the events file fails with ENOSPC."""
    (run_dir / "events.jsonl").unlink()
    os.symlink("/dev/full", run_dir / "events.jsonl")
    return "No space left on device"


def folder_taken_away(run_dir):
    """The folder is cleaned up and a file takes its place: nothing can be written there
    (whoever runs the tests, root included)."""
    shutil.move(run_dir, run_dir.with_name(run_dir.name + ".gone"))
    run_dir.write_text("not a folder")
    return "File exists"


@pytest.mark.parametrize("trouble", [swap_for_dev_full, folder_taken_away])
def test_events_that_cannot_be_written_are_reported(workdir, trouble):
    if trouble is swap_for_dev_full and not os.path.exists("/dev/full"):
        pytest.fail("this test needs /dev/full")
    proc = start_sexpgpu(*RUN, cwd=workdir)
    try:
        wait_for_step(workdir / "m", 3, proc)
        (run_dir,) = experiments(workdir / "m")
        reason = trouble(run_dir)
        # The "interrupted" annotation is made after the trouble: it cannot be delivered.
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        out, err = proc.communicate(timeout=180)
        stopping = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err
    # the sink can never deliver: the stop waited WAIT seconds for it, not the default 30
    assert stopping < 30, stopping
    logged = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    warned = [r for r in logged if r["event"] == "metrics sink write failed; retrying"]
    assert warned and reason in warned[0]["error"]
    assert warned[0]["level"] == "warning"
    (summary,) = [r for r in logged if r["event"] == "run interrupted"]
    assert summary["undelivered_events"] >= 1
    assert summary["undelivered_by_sink"] == {"0:jsonl": summary["undelivered_events"]}
    assert any(r["event"] == "metrics events not delivered" for r in logged)
    # the warning came mid-run, before the summary
    assert logged.index(warned[0]) < logged.index(summary)


def test_a_removed_events_file_is_opened_again(workdir):
    proc = start_sexpgpu(*RUN, cwd=workdir)
    try:
        wait_for_step(workdir / "m", 3, proc)
        (run_dir,) = experiments(workdir / "m")
        (run_dir / "events.jsonl").unlink()  # a clean-up script, a user
        deadline = time.monotonic() + 120  # only guards against a hang
        while not (run_dir / "events.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["text"].startswith("interrupted by SIGTERM")
    assert "the metrics file was removed or replaced; opening it again" in err


@pytest.mark.parametrize("trouble", [swap_for_dev_full, folder_taken_away])
def test_a_run_that_finishes_says_what_its_metrics_folder_lost(workdir, trouble):
    """The run goes on and exits 0 (the reports are lost, not the run), and its closing
    summary says so: how many events, each sink's error, and a status file not written."""
    # 4000 steps, a few seconds: the trouble lands mid-run, whatever the machine's load
    proc = start_sexpgpu(*RUN[:3], "4000", *RUN[4:], cwd=workdir)
    try:
        wait_for_step(workdir / "m", 3, proc)
        (run_dir,) = experiments(workdir / "m")
        reason = trouble(run_dir)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    logged = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    (summary,) = [r for r in logged if r["event"] == "run finished"]
    assert summary["undelivered_events"] >= 1
    assert reason in summary["metrics_errors"]["0:jsonl"]
    if trouble is folder_taken_away:  # the status file went with the folder
        assert (
            reason in summary["status_unwritten"]
            or "Not a directory" in summary["status_unwritten"]
        )
    else:
        assert "status_unwritten" not in summary
        assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
