"""`sexpgpu evaluate` on a run with `:load` parameters: frozen ones read from their pinned
files, and a file with other bytes refused, as a resume does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tests.e2e.helpers import run_sexpgpu
from tests.loads.helpers import teacher_tensors, write_project

from .kit import eval_points


def test_loaded_parameters_come_from_their_pinned_files(tmp_path: Path):
    sx = write_project(tmp_path)
    text = sx.read_text().replace(
        "  :seed 7)", "  :seed 7\n  :evals ((eval probe :every 2 :metrics (loss accuracy))))"
    )
    sx.write_text(text)
    run = run_sexpgpu(
        "run", "loads.sx", "--checkpoint-dir", "ck", "--metrics-dir", "m", cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    result = run_sexpgpu("evaluate", "ck/step-00000004", "--metrics-dir", "m", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    ran, again = eval_points(tmp_path, source=None), eval_points(tmp_path, source="evaluate")
    assert again[(4, "probe/loss")] == ran[(4, "probe/loss")]
    # the teacher's file with other bytes: refused, one line, nothing reported
    changed = teacher_tensors()
    changed["teacher.head.weight"] = changed["teacher.head.weight"] + np.float32(1)
    save_file(changed, str(tmp_path / "teacher.safetensors"))
    result = run_sexpgpu("evaluate", "ck/step-00000002", "--metrics-dir", "m", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    # as `run` prints it: the spec's three lines (issue 24, item 14)
    said = [line for line in result.stderr.splitlines() if line.strip() and line[0] != "{"]
    assert said[0] == (
        "sexpgpu evaluate: E-LOAD-001: a loaded parameter's file is not the one the "
        "checkpoint's run read:"
    )
    refused = said[1:-1]  # each parameter read from the changed file, a line each
    assert refused and all(line.startswith("  teacher.") and " -> " in line for line in refused)
    assert said[-1] == "restore that file, or start the run again"
    assert (2, "probe/loss") not in eval_points(tmp_path, source="evaluate")
