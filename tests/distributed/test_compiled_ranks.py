"""Every sharding under the compiled lowering on two ranks. ``optimizer`` and ``full``
go through the data-parallel matrix: a worker killed with SIGKILL (the launcher
starts the ranks again from the last checkpoint), then a signal at a later step (to
the launcher, or to one worker); the stop's checkpoint loads with safetensors.numpy,
whole tensors; and the resume ends on the bytes of a compiled run never stopped: of
the same sharding, or of ``none`` for ``optimizer`` (an update is per parameter, so
owning one changes no bit). ``none`` resumes from its own mid-run checkpoint in a new
process to the same bytes. No graph compiles twice, in any of those processes.

What the lowering does not touch is left to the eager tests, which run it for every
sharding: another device count refused (``E-DP-002``), each signal at each target.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from tests.catalogs import compile_file
from tests.e2e.helpers import (
    assert_every_checkpoint_complete,
    assert_same_tensors,
    events,
    experiments,
    wait_for_step,
)

from .kit import (
    HERE,
    PROGRAM,
    SIGNALS,
    interrupted_lines,
    launch,
    project,
    start,
    wait_until,
    worker_pid,
)

STEPS = {"none": 300, "optimizer": 300, "full": 120}
"""Long enough for the kill, the ranks' restart and a signal to land mid-run (compiled
steps are quick; fully sharded ones less so)."""

RECOMPILED = "compiled again after its first call"


def _args(shard: str) -> tuple[str, ...]:
    return ("--devices", "2", "--shard", shard, "--lowering", "compiled")


def _straight(root: Path, shard: str) -> Path:
    """A compiled two-rank run of ``shard`` never stopped, in ``root``."""
    program = "full.sx" if shard == "full" else PROGRAM
    project(root, program)
    result = launch(root, *_args(shard), steps=STEPS[shard], program=program)
    assert result.returncode == 0, result.stderr
    assert RECOMPILED not in result.stderr + result.stdout
    return root


def _losses(metrics_dir: Path) -> int:
    """The losses a run's experiment has been told, a step done again counted again."""
    return sum(
        1
        for run_dir in experiments(metrics_dir)
        for e in events(run_dir)
        if e.get("kind") == "point" and e.get("name") == "loss"
    )


def _killed_then_stopped(root: Path, shard: str, target: str, name: str) -> int:
    """A run SIGKILLed at one worker mid-run, started again by the launcher, then sent
    ``name`` (to the launcher or a worker) once the restarted ranks are stepping: the
    step it stopped at."""
    program, steps = ("full.sx" if shard == "full" else PROGRAM), STEPS[shard]
    project(root, program)
    pick = random.Random(f"compiled {shard}")
    args = (*_args(shard), "--resume", "latest", "--max-restarts", "1")
    proc = start(root, *args, steps=steps, program=program)
    try:
        wait_for_step(root / "m", pick.randint(22, 35), proc)  # after the checkpoint at 20
        killed = worker_pid(proc, 1)
        os.kill(killed, signal.SIGKILL)
        # the launcher starts the ranks again from the last checkpoint; they go on
        # writing the same experiment's events
        assert wait_until(lambda: worker_pid(proc, 1) != killed, timeout=180), proc.poll()
        base, stepped = _losses(root / "m"), pick.randint(3, 10)
        assert wait_until(lambda: _losses(root / "m") >= base + stepped, timeout=180)
        pid = worker_pid(proc, 1) if target == "worker" else proc.pid
        assert pid != killed
        os.kill(pid, SIGNALS[name])
        out, err = proc.communicate(timeout=180)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 128 + SIGNALS[name], err
    (line,) = interrupted_lines(err)
    n = int(line.rsplit(" ", 1)[1])
    assert 20 <= n < steps
    assert RECOMPILED not in out + err
    return n


@pytest.mark.slow
def test_compiled_replicas_and_sharded_states_killed_then_stopped_resume_to_the_bytes(tmp_path):
    straight = _straight(tmp_path / "straight", "none")  # the reference of both
    # replicas: the step-20 checkpoint resumed in a new process
    resumed = project(tmp_path / "none")
    shutil.copytree(straight / "ckpt" / "step-00000020", resumed / "ckpt" / "step-00000020")
    again = launch(resumed, *_args("none"), "--resume", "latest", steps=STEPS["none"])
    assert again.returncode == 0, again.stderr
    assert RECOMPILED not in again.stderr + again.stdout
    last = f"step-{STEPS['none']:08d}"
    assert_same_tensors(resumed / "ckpt" / last, straight / "ckpt" / last)
    _check(tmp_path / "optimizer", "optimizer", "launcher", "SIGTERM", straight)


@pytest.mark.slow
def test_compiled_full_shards_killed_then_stopped_resume_to_the_bytes(tmp_path):
    straight = _straight(tmp_path / "straight", "full")
    _check(tmp_path / "full", "full", "worker", "SIGTERM", straight)


def _check(root: Path, shard: str, target: str, name: str, straight: Path) -> None:
    """Killed, started again and stopped (:func:`_killed_then_stopped`); the stop's
    checkpoint whole; resumed to ``straight``'s bytes."""
    program, steps = ("full.sx" if shard == "full" else PROGRAM), STEPS[shard]
    n = _killed_then_stopped(root, shard, target, name)
    stopped = root / "ckpt" / f"step-{n:08d}"
    assert_every_checkpoint_complete(root / "ckpt")
    # the spec's snippet: whole tensors, at their declared shapes
    params = load_file(str(stopped / "params.safetensors"))
    declared = {d.path: tuple(d.type.shape) for d in compile_file(str(HERE / program)).params}
    assert {path: array.shape for path, array in params.items()} == declared
    again = launch(root, *_args(shard), "--resume", "latest", steps=steps, program=program)
    assert again.returncode == 0, again.stderr
    assert RECOMPILED not in again.stderr + again.stdout
    last = f"step-{steps:08d}"
    assert_same_tensors(root / "ckpt" / last, straight / "ckpt" / last)
