"""To the bit: a run stopped after step k and resumed equals the run never stopped."""

from __future__ import annotations

import pytest

from .helpers import assert_same_tensors, run_sexpgpu, step_dirs


def test_my_run_resumed_after_every_step_is_byte_identical(workdir):
    whole = run_sexpgpu(
        "run", "examples/my-run.sx", "--checkpoint-dir", "whole", "--metrics-dir", "m", cwd=workdir
    )
    assert whole.returncode == 0, whole.stderr
    for k in (1, 2, 3):
        location = f"part{k}"
        stopped = run_sexpgpu(
            "run",
            "examples/my-run.sx",
            "--steps",
            str(k),
            "--checkpoint-dir",
            location,
            "--metrics-dir",
            "m",
            "--resume",
            "latest",
            cwd=workdir,
        )
        assert stopped.returncode == 0, stopped.stderr
        resumed = run_sexpgpu(
            "run",
            "examples/my-run.sx",
            "--checkpoint-dir",
            location,
            "--metrics-dir",
            "m",
            "--resume",
            "latest",
            cwd=workdir,
        )
        assert resumed.returncode == 0, resumed.stderr
        assert step_dirs(workdir / location)[-1] == "step-00000004"
        assert_same_tensors(
            workdir / "whole" / "step-00000004", workdir / location / "step-00000004"
        )


@pytest.mark.slow
def test_tiny_lm_resumed_from_every_checkpoint_is_byte_identical(workdir):
    steps = "8"
    common = ["--steps", steps, "--set", "checkpoint-every=1", "--metrics-dir", "m"]
    whole = run_sexpgpu(
        "run", "examples/tiny-lm.sx", *common, "--checkpoint-dir", "whole", cwd=workdir
    )
    assert whole.returncode == 0, whole.stderr
    assert len(step_dirs(workdir / "whole")) == 8
    for k in range(1, 8):
        location = f"resumed{k}"
        result = run_sexpgpu(
            "run",
            "examples/tiny-lm.sx",
            *common,
            "--checkpoint-dir",
            location,
            "--resume",
            str(workdir / "whole" / f"step-{k:08d}"),
            cwd=workdir,
        )
        assert result.returncode == 0, result.stderr
        assert_same_tensors(
            workdir / "whole" / "step-00000008", workdir / location / "step-00000008"
        )
