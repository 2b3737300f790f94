"""A compiled bundle replays the bundling machine's kernels: `sexpgpu bundle --lowering
compiled` compiles every graph into an empty cache folder and ships it; a run from the
bundle, in a new process with no compile cache of its own, reads those kernels and
holds the bytes of the same run made from the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sexpgpu_torch.recompiles import RECOMPILED
from tests.e2e.helpers import EXAMPLES, assert_same_tensors, run_sexpgpu, sexpgpu_env, step_dirs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _log(stderr: str, event: str) -> dict:
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    return next(record for record in records if record.get("event") == event)


def test_a_compiled_bundle_replays_the_file_s_compiled_run_to_the_bit(
    tmp_path: Path, compiled_env: dict[str, str]
):
    made = run_sexpgpu(
        "bundle", EXAMPLES / "my-run.sx", "--lowering", "compiled", "-o", "run.sxb",
        cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    shown = run_sexpgpu("bundle", "--show", "run.sxb", cwd=tmp_path)
    assert "files under compiled/, compiled in" in shown.stdout, shown.stdout
    assert "lowering = compiled" in shown.stdout
    file_run = run_sexpgpu(
        "run", EXAMPLES / "my-run.sx", "--lowering", "compiled", "--checkpoint-dir", "file",
        "--metrics-dir", "m", cwd=tmp_path, env=compiled_env, timeout=900,
    )  # fmt: skip
    assert file_run.returncode == 0, file_run.stderr[-3000:]
    # no compile cache of its own: the environment names none, and the bundle's is used
    env = {k: v for k, v in sexpgpu_env().items() if not k.startswith("TORCHINDUCTOR_")}
    replay = run_sexpgpu(
        "run", "run.sxb", "--checkpoint-dir", "replay", "--metrics-dir", "m", cwd=tmp_path,
        env=env, timeout=900,
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr[-3000:]
    assert RECOMPILED not in replay.stderr
    started = _log(replay.stderr, "run started")
    assert started["choices"]["lowering"] == "compiled"
    assert started["compile_seconds"] > 0  # logged: the benchmark compares it with a cold one
    steps = step_dirs(tmp_path / "file")
    assert steps == step_dirs(tmp_path / "replay") and steps
    for step in steps:
        assert_same_tensors(tmp_path / "file" / step, tmp_path / "replay" / step)
