"""``sexpgpu.train.run`` given a bundle runs it as ``sexpgpu run NAME.sxb`` does: the
bundle plugin's source opener unpacks and checks it, and the run holds its bytes."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.helpers import EXAMPLES, run_sexpgpu, step_dirs
from tests.foundation.pluginkit import run_python

LIBRARY_RUN = """
from sexpgpu.catalog import Catalog
from sexpgpu.opening import Selection
from sexpgpu.train import RunOptions, run

outcome = run(RunOptions(selection=Selection("run.sxb"), checkpoint_dir="library"), Catalog.load())
raise SystemExit(outcome.exit_code)
"""


def test_a_library_run_of_a_bundle_holds_the_command_s_bytes(tmp_path: Path) -> None:
    made = run_sexpgpu("bundle", EXAMPLES / "my-run.sx", "-o", "run.sxb", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    by_command = run_sexpgpu("run", "run.sxb", "--checkpoint-dir", "command", cwd=tmp_path)
    assert by_command.returncode == 0, by_command.stderr
    library = run_python(LIBRARY_RUN, cwd=tmp_path, OMP_NUM_THREADS="1")
    assert library.returncode == 0, library.stderr
    steps = step_dirs(tmp_path / "command")
    assert steps and step_dirs(tmp_path / "library") == steps
    for step in steps:
        for file in ("params.safetensors", "states.safetensors", "state.json"):
            assert (tmp_path / "library" / step / file).read_bytes() == (
                tmp_path / "command" / step / file
            ).read_bytes()
