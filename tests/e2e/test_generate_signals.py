"""A signal while a step's generator makes its records (docs/signals.md, docs/generate.md):
the step is abandoned, the step before it is kept, and the resume takes the
abandoned step again to the bits of a run never stopped.

Real signals to the console script in a subprocess. Where a signal lands is not left
to the clock: the model's forward calls a throwaway plugin op, ``gate`` (the
identity), which counts its calls without gradients (one per trip of a generator:
nothing else here runs the model without gradients; the compiled lowering's warm-up
runs it on zeros, which it passes over) and, at the ``GATE_AT``-th,
waits until the test has sent the signal and created ``release``. The trip the
signal lands in is drawn at random (the same draws on every run of the suite).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.foundation.pluginkit import sexpgpu_command, user_env

from .gating import GATED_LM, make_gate_plugin
from .helpers import (
    SIGNALS,
    assert_every_checkpoint_complete,
    assert_same_tensors,
    events,
    step_dirs,
)

IMITATE, REINFORCE, TRIPS = 2, 5, 4
PROGRAM = f"""
{GATED_LM}(defdata train (sort :vocab 8 :length 3) :seq 8 :batch 4)
(defdata prompts (sort :vocab 8 :length 3 :split "rl") :seq 8 :batch 4)
(defrun gated
  :model (lm 8 8 16)
  :optimizer (adam :lr 0.01)
  :seed 5
  :checkpoint-every 1
  :counters (tokens records generated)
  :stages ((stage imitate :steps {IMITATE} :data train
            :loss (cross-entropy (model inputs) targets))
           (stage reinforce :steps {REINFORCE} :data prompts
            :generate (sample model :new-tokens {TRIPS} :samples 2 :temperature 1.0)
            :loss (let [seq (sum (* (gather (log-softmax (model sequence)) next) next-mask) :axis 1)
                        adv (- reward (group-mean reward :size 2))]
                    (neg (mean (* adv seq)))))))
"""
TOTAL = IMITATE + REINFORCE
BOUND = 120.0


@pytest.fixture(scope="module")
def plugins(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plugins")
    return make_gate_plugin(root)


def _site(root: Path, source: str = PROGRAM) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "gated.sx").write_text(source)
    (root / "gate" / "rank-0").mkdir(parents=True, exist_ok=True)
    return root


def start(site: Path, plugins: Path, *args: str, gate_at: int = 0) -> subprocess.Popen:
    return subprocess.Popen(
        [*sexpgpu_command(), "run", "gated.sx", "--metrics-dir", "m", *args],
        cwd=site,
        env=user_env([plugins], GATE_DIR=str(site / "gate"), GATE_AT=str(gate_at)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"sexpgpu hung:\n{err[-3000:]}") from None


def wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + BOUND
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"sexpgpu ended before {path.name}:\n{proc.communicate()[1]}")
        assert time.monotonic() < deadline, f"no {path.name} within {BOUND}s"
        time.sleep(0.005)


def notes(run_dir: Path) -> list[str]:
    """The run's annotations."""
    return [e.get("text", "") for e in events(run_dir) if e.get("kind") == "annotation"]


def stops(run_dir: Path) -> list[str]:
    """The run's annotations of how it stopped."""
    return [n for n in notes(run_dir) if n.startswith("interrupted")]


def step_dir(site: Path, step: int) -> Path:
    return site / "ckpt" / f"step-{step:08d}"


@pytest.fixture(scope="module", params=["torch", "compiled"])
def never_stopped(request, tmp_path_factory, plugins) -> tuple[str, Path]:
    """The program run whole on a lowering, a checkpoint at every step."""
    lowering = request.param
    site = _site(tmp_path_factory.mktemp(f"whole-{lowering}"))
    proc = start(site, plugins, "--checkpoint-dir", "ckpt", "--lowering", lowering)
    out, err = finish(proc)
    assert proc.returncode == 0, err
    return lowering, site


def _gated_run(site: Path, plugins: Path, lowering: str, at: int) -> subprocess.Popen:
    proc = start(site, plugins, "--checkpoint-dir", "ckpt", "--lowering", lowering, gate_at=at)
    wait_for(site / "gate" / "rank-0" / f"trip-{at}", proc)
    return proc


def _resume_and_compare(site: Path, plugins: Path, lowering: str, whole: Path) -> None:
    shutil.rmtree(site / "gate")
    proc = start(
        site, plugins, "--checkpoint-dir", "ckpt", "--lowering", lowering, "--resume", "latest"
    )
    out, err = finish(proc)
    assert proc.returncode == 0, err
    last = step_dir(site, TOTAL)
    assert_same_tensors(last, step_dir(whole, TOTAL))
    assert (last / "state.json").read_bytes() == (
        step_dir(whole, TOTAL) / "state.json"
    ).read_bytes()
    assert_every_checkpoint_complete(site / "ckpt")


def _trip(call: int) -> tuple[int, int]:
    """The step and the trip (from 0) of the ``call``-th call of the model without gradients."""
    return IMITATE + (call - 1) // TRIPS + 1, (call - 1) % TRIPS


@pytest.mark.slow
@pytest.mark.parametrize(
    ("never_stopped", "name"),
    [("torch", "SIGTERM"), ("torch", "SIGINT"), ("torch", "SIGHUP"), ("compiled", "SIGTERM")],
    indirect=["never_stopped"],
)
def test_a_signal_while_generating_abandons_the_step_and_the_resume_is_exact(
    tmp_path, plugins, never_stopped, name
):
    lowering, whole = never_stopped
    # a trip before the last of a step, drawn at random (the same on every suite run)
    calls = [c for c in range(1, REINFORCE * TRIPS + 1) if _trip(c)[1] < TRIPS - 1]
    at = random.Random(f"{name}-{lowering}").choice(calls)
    step, trip = _trip(at)
    site = _site(tmp_path / "site")
    proc = _gated_run(site, plugins, lowering, at)
    os.kill(proc.pid, SIGNALS[name])
    (site / "gate" / "rank-0" / "release").touch()
    out, err = finish(proc)
    kept = step - 1
    context = f"{name} at trip {trip} of step {step} ({lowering})"
    assert proc.returncode == 128 + SIGNALS[name], f"{context}: {err}"
    assert f"sexpgpu run: interrupted by {name} at step {kept}" in err.splitlines(), context
    # no trip after the signal's: the generator stopped before its next trip
    assert not (site / "gate" / "rank-0" / f"trip-{at + 1}").exists(), context
    (run_dir,) = (site / "m").iterdir()
    assert stops(run_dir) == [f"interrupted by {name} at step {kept} while generating"], context
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["step"]) == ("interrupted", kept), context
    # the step before is kept, its loader position and counters as a run never stopped has them
    assert not step_dir(site, step).exists(), context
    assert (step_dir(site, kept) / "state.json").read_bytes() == (
        step_dir(whole, kept) / "state.json"
    ).read_bytes(), context
    assert_same_tensors(step_dir(site, kept), step_dir(whole, kept))
    _resume_and_compare(site, plugins, lowering, whole)


EVERY = 3
SPARSE_PROGRAM = PROGRAM.replace(":checkpoint-every 1", f":checkpoint-every {EVERY}")


@pytest.mark.slow
@pytest.mark.parametrize("never_stopped", ["torch"], indirect=True)
@pytest.mark.parametrize("step", [IMITATE + 1, IMITATE + 3])
def test_a_signal_while_generating_between_checkpoints_is_resumed_from_its_own_checkpoint(
    tmp_path, plugins, never_stopped, step
):
    """With a checkpoint every 3 steps, the step kept is checkpointed by the signal alone:
    its ``state.json`` records where the loader is once the abandoned step's prompts are
    given back, and the resume starts from it. Step 3 is the generating stage's first (the
    step kept is the stage before's last), step 5 one inside it."""
    lowering, whole = never_stopped
    kept = step - 1
    assert kept % EVERY, "a scheduled checkpoint of the step kept would hide the signal's"
    trip = random.Random(f"between-checkpoints-{step}").randrange(TRIPS - 1)
    at = (step - IMITATE - 1) * TRIPS + trip + 1
    assert _trip(at) == (step, trip)
    site = _site(tmp_path / "site", SPARSE_PROGRAM)
    proc = _gated_run(site, plugins, lowering, at)
    os.kill(proc.pid, SIGNALS["SIGTERM"])
    (site / "gate" / "rank-0" / "release").touch()
    out, err = finish(proc)
    context = f"SIGTERM at trip {trip} of step {step}"
    assert proc.returncode == 143, f"{context}: {err}"
    scheduled = [s for s in range(1, kept) if s % EVERY == 0]
    assert step_dirs(site / "ckpt") == [f"step-{s:08d}" for s in [*scheduled, kept]], context
    (run_dir,) = (site / "m").iterdir()
    assert stops(run_dir) == [f"interrupted by SIGTERM at step {kept} while generating"]
    # the signal's checkpoint is the one a run never stopped writes at that step
    assert (step_dir(site, kept) / "state.json").read_bytes() == (
        step_dir(whole, kept) / "state.json"
    ).read_bytes(), context
    assert_same_tensors(step_dir(site, kept), step_dir(whole, kept))
    _resume_and_compare(site, plugins, lowering, whole)
    resumed = [n for n in notes(run_dir) if n.startswith("resumed from ")]
    assert [n.splitlines()[0] for n in resumed] == [f"resumed from ckpt/step-{kept:08d}"], resumed


@pytest.mark.slow
@pytest.mark.parametrize("never_stopped", ["torch"], indirect=True)
def test_a_signal_in_the_last_trip_keeps_the_step(tmp_path, plugins, never_stopped):
    lowering, whole = never_stopped
    at = 2 * TRIPS  # the last trip of the second generating step
    step, _ = _trip(at)
    site = _site(tmp_path / "site")
    proc = _gated_run(site, plugins, lowering, at)
    os.kill(proc.pid, SIGNALS["SIGTERM"])
    (site / "gate" / "rank-0" / "release").touch()
    out, err = finish(proc)
    assert proc.returncode == 143, err
    assert f"sexpgpu run: interrupted by SIGTERM at step {step}" in err.splitlines()
    (run_dir,) = (site / "m").iterdir()
    assert stops(run_dir) == [f"interrupted by SIGTERM at step {step}"]
    _resume_and_compare(site, plugins, lowering, whole)


@pytest.mark.slow
def test_kill_9_while_generating_resumes_from_the_last_checkpoint_exactly(
    tmp_path, plugins, never_stopped
):
    lowering, whole = never_stopped
    at = random.Random(f"kill-{lowering}").randint(1, REINFORCE * TRIPS)
    site = _site(tmp_path / "site")
    proc = _gated_run(site, plugins, lowering, at)
    proc.kill()
    proc.communicate()
    shutil.rmtree(site / "m")
    _resume_and_compare(site, plugins, lowering, whole)


PASS_PROGRAM = f"""
{GATED_LM}(defdata train (sort :vocab 8 :length 3) :seq 8 :batch 4)
(defrun probed
  :model (lm 8 8 16)
  :data train
  :loss (cross-entropy (model inputs) targets)
  :optimizer (adam :lr 0.01)
  :steps 6
  :seed 5
  :evals ((eval sampled :every 2 :batches 2
           :generate (sample model :new-tokens {TRIPS} :samples 2 :temperature 1.0)
           :metrics (reward generated-length))))
"""


def _pass_points(run_dir: Path) -> dict[tuple[int, str], float]:
    return {
        (e["step"], e["name"]): e["value"]
        for e in events(run_dir)
        if e.get("kind") == "point" and e["name"].startswith("sampled/")
    }


@pytest.mark.slow
def test_a_signal_while_a_pass_generates_abandons_the_pass_and_the_resume_runs_it(
    tmp_path, plugins
):
    whole = _site(tmp_path / "whole")
    (whole / "gated.sx").write_text(PASS_PROGRAM)
    proc = start(whole, plugins, "--checkpoint-dir", "ckpt")
    out, err = finish(proc)
    assert proc.returncode == 0, err
    (whole_run,) = (whole / "m").iterdir()
    expected = _pass_points(whole_run)
    assert sorted({step for step, _ in expected}) == [2, 4, 6]

    site = _site(tmp_path / "site")
    (site / "gated.sx").write_text(PASS_PROGRAM)
    at = 2 * TRIPS + 2  # the pass after step 4: the second trip of its first batch
    proc = _gated_run(site, plugins, "torch", at)
    os.kill(proc.pid, SIGNALS["SIGTERM"])
    (site / "gate" / "rank-0" / "release").touch()
    out, err = finish(proc)
    assert proc.returncode == 143, err
    assert not (site / "gate" / "rank-0" / f"trip-{at + 1}").exists()
    (run_dir,) = (site / "m").iterdir()
    assert stops(run_dir) == ["interrupted by SIGTERM at step 4 while generating"]
    assert (4, "sampled/reward") not in _pass_points(run_dir)  # it reported nothing
    state = json.loads((step_dir(site, 4) / "state.json").read_text())
    assert state["evals_pending"] == ["sampled"]

    shutil.rmtree(site / "gate")
    proc = start(site, plugins, "--checkpoint-dir", "ckpt", "--resume", "latest")
    out, err = finish(proc)
    assert proc.returncode == 0, err
    assert _pass_points(run_dir) == expected  # the pass run again: the same numbers, bit for bit
    assert_same_tensors(step_dir(site, 6), step_dir(whole, 6))
