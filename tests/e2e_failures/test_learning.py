"""The examples learn: a full default run of each, judged by its own metrics."""

from __future__ import annotations

import shutil

import pytest

from tests.e2e.helpers import EXAMPLES, events, experiments, run_sexpgpu

from .kit import losses


@pytest.mark.slow
def test_tiny_lm_learns_to_sort(tmp_path):
    shutil.copy(EXAMPLES / "tiny-lm.sx", tmp_path)
    result = run_sexpgpu("run", "tiny-lm.sx", "--metrics-dir", "m", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (run_dir,) = experiments(tmp_path / "m")
    loss = losses(run_dir)
    assert sorted(loss) == list(range(1, 201))
    last = sum(loss[s] for s in range(191, 201)) / 10
    assert last <= loss[1] / 2, (loss[1], last)


@pytest.mark.slow
def test_cnn_probe_accuracy_rises_above_0_8(tmp_path):
    shutil.copy(EXAMPLES / "cnn.sx", tmp_path)
    result = run_sexpgpu("run", "cnn.sx", "--metrics-dir", "m", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (run_dir,) = experiments(tmp_path / "m")
    accuracy = {e["step"]: e["value"] for e in events(run_dir) if e.get("name") == "probe/accuracy"}
    assert sorted(accuracy) == [50, 100, 150, 200]
    assert accuracy[200] > 0.8, accuracy
    assert accuracy[200] > accuracy[50], accuracy
