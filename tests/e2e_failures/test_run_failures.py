"""Failures once a run has started: one line naming the step, exit 1, the status file
and the metrics stream say `failed`, traceback.txt keeps the detail, and the last
checkpoint is intact and resumable."""

from __future__ import annotations

import re
import resource
import subprocess
from pathlib import Path

from tests.e2e.helpers import (
    SEXPGPU,
    assert_same_tensors,
    experiments,
    run_sexpgpu,
    sexpgpu_env,
    status,
    step_dirs,
)

from .kit import FLAKY_SX, TEXT_SX, assert_failed_run, error_line, flaky_plugin, losses

RUN = ["--checkpoint-dir", "ckpt", "--metrics-dir", "m"]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _traceback_line(step: int, what: str) -> re.Pattern[str]:
    return re.compile(
        rf"^sexpgpu run: step {step}: {what} \(traceback in (m/[\w-]+)/traceback\.txt\)$"
    )


def test_take_out_of_range_fails_at_run_time_and_keeps_the_last_checkpoint(tmp_path):
    # The shape checker knows a text batch is i64[4, 8], not which values it holds:
    # bytes 0..15 fit a 16-row table, a file with bytes beyond 15 does not.
    (tmp_path / "text.sx").write_text(TEXT_SX)
    data = tmp_path / "data.txt"
    data.write_bytes(bytes(i % 16 for i in range(200)))
    small = ["run", "text.sx", "--set", "vocab=16", *RUN]
    first = run_sexpgpu(*small, "--steps", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    kept = {p.name: p.read_bytes() for p in (tmp_path / "ckpt" / "step-00000002").iterdir()}

    # The same size, so the loader's saved position still fits; other values.
    data.write_bytes(bytes(range(200)))
    result = run_sexpgpu(*small, "--resume", "latest", cwd=tmp_path)
    line = error_line(result)
    # At the `take` in the model's forward (line 8), the user's error: no traceback.
    # ("step 3: " comes first once run.py names the step of every error in a step.)
    match = re.match(
        r"^sexpgpu run: (?:step 3: )?text\.sx:8:\d+: take: index (\d+) is outside the "
        r"table's 16 rows \(indices here are (\d+)\.\.(\d+)\); is the data's vocabulary "
        r"larger than the table\?$",
        line,
    )
    assert match, line
    bad, low, high = map(int, match.groups())
    assert bad == high and 16 <= high <= 199 and low <= high, line
    run_dir = assert_failed_run(tmp_path / "m", line)
    assert not (run_dir / "traceback.txt").exists()
    st = status(run_dir)
    assert st["step"] == 2 and st["checkpoint"] == "ckpt/step-00000002", st
    # Nothing of step 3 was written, and step 2 is byte for byte what it was.
    assert step_dirs(tmp_path / "ckpt") == ["step-00000002"]
    after = {p.name: p.read_bytes() for p in (tmp_path / "ckpt" / "step-00000002").iterdir()}
    assert after == kept


def test_an_exception_in_a_step_after_a_checkpoint_fails_then_resume_finishes(tmp_path):
    site = flaky_plugin(tmp_path)
    (tmp_path / "flaky.sx").write_text(FLAKY_SX)
    sound = sexpgpu_env(PYTHONPATH=str(site))
    broken = sexpgpu_env(PYTHONPATH=str(site), FLAKY_FAIL_AT="5")

    # A run never broken, to compare the checkpoints with.
    ref = run_sexpgpu(
        "run",
        "flaky.sx",
        "--checkpoint-dir",
        "ref",
        "--metrics-dir",
        "refm",
        env=sound,
        cwd=tmp_path,
    )
    assert ref.returncode == 0, ref.stderr

    result = run_sexpgpu("run", "flaky.sx", *RUN, "--resume", "latest", env=broken, cwd=tmp_path)
    line = error_line(result)
    match = _traceback_line(5, r"ValueError: flaky source broke at batch 5").match(line)
    assert match, line
    run_dir = assert_failed_run(tmp_path / "m", line)
    assert match.group(1) == f"m/{run_dir.name}"
    text = (run_dir / "traceback.txt").read_text()
    assert "next_batch" in text and text.rstrip().endswith(
        "ValueError: flaky source broke at batch 5"
    )
    st = status(run_dir)
    assert st["step"] == 4 and st["checkpoint"] == "ckpt/step-00000004", st
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]
    # The checkpoints before the failure are intact: the bits of the run never broken.
    assert step_dirs(tmp_path / "ckpt") == ["step-00000002", "step-00000004"]
    assert_same_tensors(tmp_path / "ckpt" / "step-00000004", tmp_path / "ref" / "step-00000004")

    # The plugin fixed, the same command continues from step 4 and finishes.
    again = run_sexpgpu("run", "flaky.sx", *RUN, "--resume", "latest", env=sound, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "Traceback" not in again.stderr
    st = status(run_dir)
    assert st["state"] == "finished" and st["step"] == 6, st
    assert "error" not in st or st["error"] in (None, ""), st
    assert sorted(losses(run_dir)) == [1, 2, 3, 4, 5, 6]
    assert step_dirs(tmp_path / "ckpt") == ["step-00000002", "step-00000004", "step-00000006"]
    assert_same_tensors(tmp_path / "ckpt" / "step-00000006", tmp_path / "ref" / "step-00000006")


def test_a_sexpgpu_error_inside_a_step_names_the_step(tmp_path):
    site = flaky_plugin(tmp_path)
    (tmp_path / "flaky.sx").write_text(FLAKY_SX)
    env = sexpgpu_env(PYTHONPATH=str(site), FLAKY_FAIL_AT="3", FLAKY_KIND="sexp")
    line = error_line(run_sexpgpu("run", "flaky.sx", *RUN, env=env, cwd=tmp_path))
    run_dir = assert_failed_run(tmp_path / "m", line)
    assert status(run_dir)["checkpoint"] == "ckpt/step-00000002"
    assert step_dirs(tmp_path / "ckpt") == ["step-00000002"]
    # No traceback file: a sexpgpu error is the user's to fix, and says all there is.
    assert not (run_dir / "traceback.txt").exists()
    assert line == "sexpgpu run: step 3: flaky source lost its data at batch 3", line


def test_a_data_file_changed_under_a_checkpoint_is_refused_on_resume(tmp_path):
    (tmp_path / "text.sx").write_text(TEXT_SX)
    data = tmp_path / "data.txt"
    data.write_bytes(bytes(range(256)) * 4)  # 127 windows of 8+1: 31 batches of 4
    first = run_sexpgpu("run", "text.sx", *RUN, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    # Now one batch per epoch, and the checkpoint's loader is 4 batches in.
    data.write_bytes(bytes(range(33)))
    result = run_sexpgpu("run", "text.sx", *RUN, "--steps", "6", "--resume", "latest", cwd=tmp_path)
    line = error_line(result)
    assert line == (
        "sexpgpu run: E-DATA-006: data source 'text' cannot restore position "
        "{'epoch': 0, 'index': 4}: an epoch of this data has 1 batches (did the data file change?)"
    ), line
    assert step_dirs(tmp_path / "ckpt") == ["step-00000002", "step-00000004"]
    (run_dir,) = experiments(tmp_path / "m")
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]
    assert status(run_dir)["state"] == "finished"


def test_a_metrics_folder_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "text.sx").write_text(TEXT_SX)
    (tmp_path / "data.txt").write_bytes(bytes(range(100)))
    (tmp_path / "m").write_text("a file where the metrics folder should be")
    line = error_line(run_sexpgpu("run", "text.sx", *RUN, cwd=tmp_path))
    assert line.startswith("sexpgpu run: cannot use m as the metrics folder: "), line
    assert not (tmp_path / "ckpt").exists()  # refused before training: no folder left


def _file_size_cap(limit: int):
    """For ``preexec_fn``: no file the process writes may grow past ``limit`` bytes, as
    a disk that fills does (a write fails with EFBIG; Python ignores SIGXFSZ)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return cap


def test_a_checkpoint_the_disk_cannot_hold_fails_the_run_naming_its_step(tmp_path):
    # 64 KiB holds the metrics and the status file, not tiny-lm's 111 KB of parameters:
    # the first checkpoint, at step 2, cannot be written.
    args = ["run", EXAMPLES / "tiny-lm.sx", "--steps", "6", "--set", "checkpoint-every=2", *RUN]
    result = subprocess.run(
        [*SEXPGPU, *map(str, args)],
        cwd=tmp_path,
        env=sexpgpu_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_file_size_cap(64 * 1024),
    )
    line = error_line(result)
    assert re.match(
        r"^sexpgpu run: step 2: E-STORAGE-005: cannot write ckpt/step-00000002/\w+\.safetensors"
        r": File too large$",
        line,
    ), line
    assert_failed_run(tmp_path / "m", line)
    # nothing was committed: experiment.json, written last, is not there
    assert not list((tmp_path / "ckpt").glob("step-*/experiment.json"))
