"""The finite guard: a non-finite proposal stops the run with nothing committed."""

from __future__ import annotations

import re

from .helpers import events, experiments, run_sexpgpu, status, step_dirs

MESSAGE = re.compile(
    r"^sexpgpu run: step (\d+): the proposed (parameter of [\w.]+|state [\w.]+/\w+) "
    r"has (\d+) values that are not finite; nothing was committed$"
)


def test_guard_stops_with_nothing_committed_and_resume_replays(workdir):
    ok = run_sexpgpu(
        "run",
        "examples/my-run.sx",
        "--steps",
        "2",
        "--checkpoint-dir",
        "ckpt",
        "--metrics-dir",
        "m",
        cwd=workdir,
    )
    assert ok.returncode == 0, ok.stderr
    before = (workdir / "ckpt" / "step-00000002" / "params.safetensors").read_bytes()
    bad = run_sexpgpu(
        "run",
        "examples/my-run.sx",
        "--set",
        "guard=true",
        "--set",
        "lr=1e39",
        "--checkpoint-dir",
        "ckpt",
        "--metrics-dir",
        "m",
        "--resume",
        "latest",
        cwd=workdir,
    )
    assert bad.returncode == 1, bad.stderr
    lines = [line for line in bad.stderr.splitlines() if line.startswith("sexpgpu run:")]
    assert len(lines) == 1, bad.stderr
    match = MESSAGE.match(lines[0])
    assert match, lines[0]
    assert int(match.group(1)) == 3
    (run_dir,) = experiments(workdir / "m")
    st = status(run_dir)
    assert st["state"] == "failed"
    error = lines[0].removeprefix("sexpgpu run: ")
    assert st["error"] == error
    assert events(run_dir)[-1]["text"] == f"failed: {error}"
    # The last checkpoint is intact and nothing of step 3 was written.
    assert step_dirs(workdir / "ckpt") == ["step-00000002"]
    assert (workdir / "ckpt" / "step-00000002" / "params.safetensors").read_bytes() == before
    # A resume from it replays the step.
    again = run_sexpgpu(
        "run",
        "examples/my-run.sx",
        "--checkpoint-dir",
        "ckpt",
        "--metrics-dir",
        "m",
        "--resume",
        "latest",
        cwd=workdir,
    )
    assert again.returncode == 0, again.stderr
    assert step_dirs(workdir / "ckpt") == ["step-00000002", "step-00000004"]


def test_guard_is_off_by_default(workdir):
    result = run_sexpgpu(
        "run", "examples/my-run.sx", "--set", "lr=1e39", "--metrics-dir", "m", cwd=workdir
    )
    # Without the guard the run goes on with whatever the numbers became.
    assert result.returncode == 0, result.stderr
