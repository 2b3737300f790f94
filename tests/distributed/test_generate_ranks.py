"""A generator on two ranks (docs/generate.md): a signal while it samples does not
abandon the step, since the ranks look for a signal together only at a step boundary;
the generation finishes, every rank stops after that step, and the resume is exact.

The model's forward holds the ``gate`` op (tests/e2e/gating.py): rank 0 waits in a
chosen trip until the signal has been sent to the launcher.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.gating import GATED_LM, make_gate_plugin
from tests.e2e.helpers import assert_same_tensors, events
from tests.foundation.pluginkit import sexpgpu_command, user_env

from .kit import DEVICE

TRIPS = 4
PROGRAM = f"""
{GATED_LM}(defdata prompts (sort :vocab 8 :length 3) :seq 8 :batch 4)
(defrun ranked
  :model (lm 8 8 16)
  :data prompts
  :generate (sample model :new-tokens {TRIPS} :samples 2 :temperature 1.0)
  :loss (let [seq (sum (* (gather (log-softmax (model sequence)) next) next-mask) :axis 1)]
          (neg (mean (* (- reward (group-mean reward :size 2)) seq))))
  :optimizer (adam :lr 0.01)
  :steps 5
  :seed 7
  :counters (records generated)
  :checkpoint-every 1)
"""
BOUND = 180.0


def _start(site: Path, plugins: Path, *args: str, gate_at: int = 0) -> subprocess.Popen:
    return subprocess.Popen(
        [*sexpgpu_command(), "run", "ranked.sx", "--devices", "2", "--device", DEVICE]
        + ["--checkpoint-dir", "ckpt", "--metrics-dir", "m", *args],
        cwd=site,
        env=user_env([plugins], GATE_DIR=str(site / "gate"), GATE_AT=str(gate_at)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> str:
    try:
        return proc.communicate(timeout=BOUND)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("sexpgpu hung:\n" + proc.communicate()[1][-3000:]) from None


def _site(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "ranked.sx").write_text(PROGRAM)
    return root


@pytest.mark.slow
def test_two_ranks_finish_the_generation_and_stop_together_after_the_step(tmp_path):
    plugins = make_gate_plugin(tmp_path / "plugins")
    whole = _site(tmp_path / "whole")
    proc = _start(whole, plugins)
    err = _finish(proc)
    assert proc.returncode == 0, err
    # each rank makes and counts its part; the run counts them all (no stop token: every
    # record takes all its trips)
    state = json.loads((whole / "ckpt" / "step-00000005" / "state.json").read_text())
    assert state["counters"] == {"records": 5 * 4 * 2, "generated": 5 * 4 * 2 * TRIPS}

    site = _site(tmp_path / "site")
    at = 2 * TRIPS + 2  # step 3, its second trip
    proc = _start(site, plugins, gate_at=at)
    gate = site / "gate" / "rank-0"
    deadline = time.monotonic() + BOUND
    while not (gate / f"trip-{at}").exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "rank 0 never reached the gated trip"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.5)  # the launcher passes it on to its workers meanwhile
    (gate / "release").touch()
    err = _finish(proc)
    assert proc.returncode == 143, err
    # the generation went on to its last trip and the step was taken
    assert (gate / f"trip-{3 * TRIPS}").exists()
    assert "sexpgpu run: interrupted by SIGTERM at step 3" in err.splitlines(), err[-2000:]
    (run_dir,) = (site / "m").iterdir()
    stops = [e["text"] for e in events(run_dir) if e.get("text", "").startswith("interrupted")]
    assert stops == ["interrupted by SIGTERM at step 3"]

    shutil.rmtree(site / "gate")
    proc = _start(site, plugins, "--resume", "latest")
    err = _finish(proc)
    assert proc.returncode == 0, err
    assert_same_tensors(site / "ckpt" / "step-00000005", whole / "ckpt" / "step-00000005")
