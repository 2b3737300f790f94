"""A checkpoint is reported the moment it is stored (annotation, status file, log line),
not when the next checkpoint or the end waits for it: a run killed outright after a
checkpoint is stored still names it."""

from __future__ import annotations

import json
import signal
import time

from .helpers import events, experiments, start_sexpgpu

EVERY = 200


def wait_for(what, proc, timeout: float = 120):
    """Poll ``what()`` until it returns something true; fail if the run ends first."""
    deadline = time.monotonic() + timeout  # only guards against a hang
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the run ended first: rc={proc.returncode}\n{err}")
        time.sleep(0.005)
    raise AssertionError("not seen in time")


def read_status(workdir):
    for run_dir in experiments(workdir / "m"):
        try:
            return json.loads((run_dir / "status.json").read_text())
        except (OSError, ValueError):  # not written yet
            return None
    return None


def test_sigkill_after_a_checkpoint_is_stored_finds_it_in_status_and_events(workdir):
    proc = start_sexpgpu(
        "run",
        "examples/tiny-lm.sx",
        "--steps",
        "1000000",
        "--set",
        f"checkpoint-every={EVERY}",
        "--checkpoint-dir",
        "ckpt",
        "--metrics-dir",
        "m",
        cwd=workdir,
    )
    try:
        first = workdir / "ckpt" / f"step-{EVERY:08d}"
        wait_for(lambda: (first / "experiment.json").exists(), proc)

        def names_it():
            st = read_status(workdir)
            return st if st and (st["checkpoint"] or "").endswith(first.name) else None

        st = wait_for(names_it, proc)
        # Reported when stored, not when the next checkpoint (step 400) waited for it.
        assert EVERY <= st["step"] < 2 * EVERY
        assert not (workdir / "ckpt" / f"step-{2 * EVERY:08d}").exists()
        (run_dir,) = experiments(workdir / "m")

        def annotated():
            return [
                e
                for e in events(run_dir)
                if e["kind"] == "annotation" and e["text"].startswith("checkpoint ")
            ]

        (note,) = wait_for(annotated, proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert note["step"] == EVERY and note["text"].endswith(f"ckpt/{first.name}")
    assert note["seconds"] >= note["blocked"] >= 0
    killed = json.loads((run_dir / "status.json").read_text())
    assert killed["state"] == "running"  # killed outright: nothing more is written
    assert killed["checkpoint"].endswith(f"ckpt/{first.name}")
    assert [e for e in events(run_dir) if e["kind"] == "annotation"] == [note]
