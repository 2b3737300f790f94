"""Three ranks, fully sharded, on a file source (``text.sx``): each rank reads only
its rows of every batch from the file, past the ends of epochs; its slices are cut
unevenly (a table of 256 rows, a scalar held by one rank alone). A run stopped by a
signal at a random step resumes to the bytes of a run never stopped; that run ends
within float tolerance of one rank's (3.5e-5 apart at most; a batch taken in another
order is 0.18 apart); and its eval pass (4 batches shared out across 3 ranks) gives
what ``sexpgpu evaluate`` gives in one process."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.e2e.helpers import assert_every_checkpoint_complete, assert_same_tensors, wait_for_step

from .kit import SIGNALS, interrupted_lines, last_pass_and_evaluate, launch, project, start

PROGRAM = "text.sx"
THREE = ("--devices", "3", "--shard", "full")
STEPS = 40
"""A 2,600-byte corpus is 6 batches of 24 records of 16 bytes: 40 steps cross 6 epoch ends."""


def _project(root):
    project(root, PROGRAM)
    corpus = np.random.default_rng(11).integers(0, 256, 2600, dtype=np.uint8)
    (root / "corpus.txt").write_bytes(corpus.tobytes())
    return root


@pytest.mark.slow
def test_three_fully_sharded_ranks_on_a_file_resume_to_the_bytes_and_evaluate_alike(tmp_path):
    straight = _project(tmp_path / "straight")
    result = launch(straight, *THREE, steps=STEPS, program=PROGRAM)
    assert result.returncode == 0, result.stderr
    root = _project(tmp_path / "stopped")
    proc = start(root, *THREE, "--resume", "latest", steps=STEPS, program=PROGRAM)
    wait_for_step(root / "m", random.Random("three ranks").randint(12, 25), proc)
    os.kill(proc.pid, SIGNALS["SIGTERM"])
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + SIGNALS["SIGTERM"], err
    (line,) = interrupted_lines(err)
    assert int(line.rsplit(" ", 1)[1]) < STEPS
    assert_every_checkpoint_complete(root / "ckpt")
    again = launch(root, *THREE, "--resume", "latest", steps=STEPS, program=PROGRAM)
    assert again.returncode == 0, again.stderr
    last = f"step-{STEPS:08d}"
    assert_same_tensors(root / "ckpt" / last, straight / "ckpt" / last)
    alone = _project(tmp_path / "alone")
    one = launch(alone, steps=STEPS, program=PROGRAM)
    assert one.returncode == 0, one.stderr
    ranks, single = (
        load_file(str(r / "ckpt" / last / "params.safetensors")) for r in (root, alone)
    )
    assert max(float(np.abs(ranks[k] - single[k]).max()) for k in single) < 1e-3
    in_run, evaluated = last_pass_and_evaluate(straight, tmp_path / "copy", "probe/loss", STEPS)
    assert evaluated == [in_run]
