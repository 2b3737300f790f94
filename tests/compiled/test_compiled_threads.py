"""The compiled lowering keeps the bits with several CPU threads (issue 23's reproduction).

The rest of the suite runs `sexpgpu` with ``OMP_NUM_THREADS=1``. With two threads,
inductor's CPU code for an embedding's backward (an add into indexed rows) used
atomic adds across the threads, so two processes of the same run disagreed in the
last bits, and a resume disagreed with the run it continued. Here the reproduction
runs as a user ran it, with two threads: an uninterrupted run, the same run again
in a new process, and its step-4 checkpoint resumed in a new process; all three
must hold the same bytes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sexpgpu_torch.recompiles import RECOMPILED
from tests.compiled.conftest import run_named
from tests.e2e.helpers import EXAMPLES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

THREADS = "2"
FILES = ("params.safetensors", "states.safetensors")


def _run(folder: Path, env: dict[str, str], name: str, *args: str) -> None:
    result = run_named(
        folder, env, str(EXAMPLES / "my-run.sx"), name, "--steps", "6", "--lowering", "compiled",
        *args,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert RECOMPILED not in result.stderr  # no graph compiled again after warm-up


def _bytes(step_dir: Path) -> dict[str, bytes]:
    return {name: (step_dir / name).read_bytes() for name in FILES}


def test_my_run_compiled_on_two_threads_resumes_and_repeats_to_the_bit(
    tmp_path: Path, compiled_env: dict[str, str]
):
    env = {**compiled_env, "OMP_NUM_THREADS": THREADS}
    _run(tmp_path, env, "A")
    _run(tmp_path, env, "again")
    (tmp_path / "B").mkdir()
    shutil.copytree(tmp_path / "A" / "step-00000004", tmp_path / "B" / "step-00000004")
    _run(tmp_path, env, "B", "--resume", "latest")

    for step in ("step-00000002", "step-00000004", "step-00000006"):
        assert _bytes(tmp_path / "again" / step) == _bytes(tmp_path / "A" / step), step
    assert _bytes(tmp_path / "B" / "step-00000006") == _bytes(tmp_path / "A" / "step-00000006")
    recorded = (tmp_path / "A" / "step-00000006" / "experiment.json").read_text()
    assert f'"cpu.threads": "{THREADS}"' in recorded
