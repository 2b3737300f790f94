"""Signals stop a run at a step boundary with a checkpoint of that step; nothing is lost."""

from __future__ import annotations

import json
import random
import signal
import time

import pytest

from .helpers import (
    SIGNALS,
    assert_every_checkpoint_complete,
    assert_same_tensors,
    events,
    experiments,
    run_sexpgpu,
    sexpgpu_env,
    slow_writes_plugin,
    start_sexpgpu,
    status,
    step_dirs,
    wait_for_step,
)

STEPS = "200"
ARGS = ["examples/tiny-lm.sx", "--steps", STEPS, "--metrics-dir", "m", "--checkpoint-dir", "ckpt"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    import shutil

    from .helpers import EXAMPLES

    root = tmp_path_factory.mktemp("whole")
    shutil.copytree(EXAMPLES, root / "examples")
    result = run_sexpgpu("run", *ARGS, cwd=root)
    assert result.returncode == 0, result.stderr
    return root / "ckpt" / f"step-{int(STEPS):08d}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT", "SIGHUP"])
@pytest.mark.parametrize("draw", [1, 2])
def test_a_signal_stops_at_a_step_boundary_and_resume_is_exact(workdir, uninterrupted, name, draw):
    # Random steps, but the same ones on every run of the suite.
    at = random.Random(f"{name}-{draw}").randint(2, 50)
    proc = start_sexpgpu("run", *ARGS, "--resume", "latest", cwd=workdir)
    wait_for_step(workdir / "m", at, proc)
    proc.send_signal(SIGNALS[name])
    out, err = proc.communicate(timeout=120)
    signum = SIGNALS[name]
    assert proc.returncode == 128 + signum, err
    (run_dir,) = experiments(workdir / "m")
    st = status(run_dir)
    n = st["step"]
    assert n >= at
    assert f"sexpgpu run: interrupted by {name} at step {n}" in err.splitlines()
    stream = events(run_dir)
    assert f"interrupted by {name} at step {n}" in [e.get("text") for e in stream]
    assert stream[-1]["kind"] != "done" and all(e["kind"] != "done" for e in stream)
    assert st["state"] == "interrupted"
    assert f"step-{n:08d}" in step_dirs(workdir / "ckpt")
    assert st["checkpoint"].endswith(f"step-{n:08d}")

    resumed = run_sexpgpu("run", *ARGS, "--resume", "latest", cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    assert status(run_dir)["state"] == "finished"
    assert_same_tensors(uninterrupted, workdir / "ckpt" / f"step-{int(STEPS):08d}")


@pytest.mark.slow
def test_sigterm_and_sighup_together_are_one_clean_stop(workdir):
    proc = start_sexpgpu("run", *ARGS, cwd=workdir)
    wait_for_step(workdir / "m", 3, proc)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGHUP)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    (run_dir,) = experiments(workdir / "m")
    assert status(run_dir)["state"] == "interrupted"
    n = status(run_dir)["step"]
    assert f"step-{n:08d}" in step_dirs(workdir / "ckpt")


@pytest.mark.slow
def test_a_second_sigint_ends_the_process_at_once(workdir, tmp_path):
    # The stop's checkpoint takes minutes to write, so only the second SIGINT can
    # end the run within the bound: the orderly stop never finishes.
    env = sexpgpu_env(PYTHONPATH=str(slow_writes_plugin(tmp_path)), SLOW_WRITE_SECONDS="300")
    args = [*ARGS[:-1], f"slowwrite://{workdir / 'ckpt'}"]
    proc = start_sexpgpu("run", *args, cwd=workdir, env=env)
    wait_for_step(workdir / "m", 3, proc)
    proc.send_signal(signal.SIGINT)
    (run_dir,) = experiments(workdir / "m")
    deadline = time.monotonic() + 60  # the first stop is under way: reported, writing
    while "interrupted by SIGINT" not in (run_dir / "events.jsonl").read_text():
        assert time.monotonic() < deadline, "the first SIGINT was not reported"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert status(run_dir)["state"] == "running"  # the orderly stop's end never came
    assert not list((workdir / "ckpt").glob("step-*/experiment.json"))


@pytest.mark.slow
def test_sigkill_then_resume_repeats_the_steps_after_the_last_checkpoint(workdir, uninterrupted):
    args = [*ARGS, "--set", "checkpoint-every=10", "--resume", "latest"]
    proc = start_sexpgpu("run", *args, cwd=workdir)
    wait_for_step(workdir / "m", 15, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    (run_dir,) = experiments(workdir / "m")
    assert status(run_dir)["state"] == "running"
    done = step_dirs(workdir / "ckpt")
    assert done and done[-1] >= "step-00000010"
    time.sleep(0.1)
    resumed = run_sexpgpu("run", *args, cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_tensors(uninterrupted, workdir / "ckpt" / f"step-{int(STEPS):08d}")


def test_a_signal_before_the_first_step_exits_promptly(workdir):
    proc = start_sexpgpu("run", *ARGS, cwd=workdir)
    seen = []
    for line in proc.stderr:  # JSON log lines; "compiling" comes before compile and lowering
        seen.append(line)
        if '"compiling"' in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    err = "".join(seen) + err
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "sexpgpu run: interrupted by SIGINT at step 0" in err.splitlines()
    assert not (workdir / "ckpt").exists() or not step_dirs(workdir / "ckpt")


@pytest.mark.slow
def test_an_eval_pass_in_flight_stops_reports_nothing_and_is_run_again_by_the_resume(workdir):
    source = workdir / "examples" / "tiny-lm.sx"
    source.write_text(
        source.read_text().replace(
            "(eval probe :every 50 :data train :batches 2",
            "(eval probe :every 5 :data train :batches 5000",
        )
    )
    args = ["examples/tiny-lm.sx", "--steps", "8", "--metrics-dir", "m", "--checkpoint-dir", "ckpt"]
    proc = start_sexpgpu("run", *args, cwd=workdir)
    wait_for_step(workdir / "m", 5, proc)  # the pass at step 5 starts right after this point
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "sexpgpu run: interrupted by SIGTERM at step 5" in err.splitlines()
    (run_dir,) = experiments(workdir / "m")
    assert not [e for e in events(run_dir) if e.get("name", "").startswith("probe/")]
    state = json.loads((workdir / "ckpt" / "step-00000005" / "state.json").read_text())
    assert state["evals_pending"] == ["probe"]

    source.write_text(source.read_text().replace(":batches 5000", ":batches 2"))
    resumed = run_sexpgpu("run", *args, "--resume", "latest", cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    probe = [e for e in events(run_dir) if e.get("name", "").startswith("probe/")]
    assert {e["step"] for e in probe} == {5}


@pytest.mark.slow
def test_a_signal_while_checkpoints_are_being_written_leaves_only_complete_ones(workdir):
    # A wider model with a checkpoint every step: a background write is nearly
    # always in flight when the signal lands.
    wide = [
        "examples/tiny-lm.sx", "--steps", "40", "--set", "dim=256", "--set", "checkpoint-every=1",
    ]  # fmt: skip
    whole = run_sexpgpu(
        "run", *wide, "--metrics-dir", "m-whole", "--checkpoint-dir", "whole", cwd=workdir
    )
    assert whole.returncode == 0, whole.stderr

    wide += ["--metrics-dir", "m"]
    proc = start_sexpgpu(
        "run", *wide, "--checkpoint-dir", "ckpt", "--resume", "latest", cwd=workdir
    )
    wait_for_step(workdir / "m", 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert_every_checkpoint_complete(workdir / "ckpt")
    resumed = run_sexpgpu(
        "run", *wide, "--checkpoint-dir", "ckpt", "--resume", "latest", cwd=workdir
    )
    assert resumed.returncode == 0, resumed.stderr
    assert_same_tensors(workdir / "whole" / "step-00000040", workdir / "ckpt" / "step-00000040")
