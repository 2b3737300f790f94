"""Every sharding under the compiled lowering: two ranks stopped by a signal at a random
step (to the launcher, or to one worker) resume to the bytes of a compiled run never
stopped: of the same sharding, or of ``none`` for ``optimizer`` (an update is per
parameter, so owning one changes no bit), and no graph compiles twice."""

from __future__ import annotations

import os
import random

import pytest

from tests.e2e.helpers import assert_every_checkpoint_complete, assert_same_tensors, wait_for_step

from .kit import PROGRAM, SIGNALS, interrupted_lines, launch, project, start, worker_pid

STEPS = {"none": 300, "optimizer": 300, "full": 120}
"""Long enough for a signal at step 3-30 to land mid-run (compiled steps are quick; a
fully sharded one less so)."""


@pytest.mark.slow
@pytest.mark.parametrize(
    "shard, target, name",
    [
        ("none", "worker", "SIGHUP"),
        ("optimizer", "launcher", "SIGTERM"),
        ("full", "worker", "SIGTERM"),
    ],
)
def test_compiled_ranks_stop_on_a_signal_and_resume_to_the_bytes(tmp_path, shard, target, name):
    program, steps = ("full.sx" if shard == "full" else PROGRAM), STEPS[shard]
    args = ("--devices", "2", "--shard", shard, "--lowering", "compiled")
    straight = project(tmp_path / "straight", program)
    same = ("--shard", "none") if shard == "optimizer" else ()
    result = launch(straight, *args, *same, steps=steps, program=program)
    assert result.returncode == 0, result.stderr
    root = project(tmp_path / "stopped", program)
    proc = start(root, *args, "--resume", "latest", steps=steps, program=program)
    wait_for_step(root / "m", random.Random(f"compiled {shard}").randint(3, 30), proc)
    os.kill(worker_pid(proc, 1) if target == "worker" else proc.pid, SIGNALS[name])
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + SIGNALS[name], err
    (line,) = interrupted_lines(err)
    assert_every_checkpoint_complete(root / "ckpt")
    n = int(line.rsplit(" ", 1)[1])
    assert n < steps
    again = launch(root, *args, "--resume", "latest", steps=steps, program=program)
    assert again.returncode == 0, again.stderr
    last = f"step-{steps:08d}"
    assert_same_tensors(root / "ckpt" / last, straight / "ckpt" / last)
    for run in (result, again):
        assert "compiled again after its first call" not in run.stderr + run.stdout
