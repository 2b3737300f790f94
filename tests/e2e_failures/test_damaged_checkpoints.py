"""Damaged checkpoints through `sexpgpu run --resume`: refused with one line and its
code, never taken for a fresh start: no new step, no training, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.helpers import events, experiments, refused_in_process, run_sexpgpu, step_dirs

from .kit import RESUME_RUN as RUN
from .kit import error_line

STEP4 = Path("ckpt/step-00000004")


def _snapshot(workdir: Path) -> dict[str, bytes]:
    """Every file under the checkpoint and metrics folders, by path."""
    return {
        str(p.relative_to(workdir)): p.read_bytes()
        for folder in ("ckpt", "m")
        for p in sorted((workdir / folder).rglob("*"))
        if p.is_file()
    }


def _truncate(path: Path, cut: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:-cut])


DAMAGE = {
    "truncated params": (
        lambda w: _truncate(w / STEP4 / "params.safetensors"),
        "E-CKPT-002: ckpt/step-00000004/params.safetensors is damaged: its tensors need",
    ),
    "truncated states": (
        lambda w: _truncate(w / STEP4 / "states.safetensors"),
        "E-CKPT-002: ckpt/step-00000004/states.safetensors is damaged",
    ),
    "experiment.json not JSON": (
        lambda w: (w / STEP4 / "experiment.json").write_text('{"format": 1, "params": ['),
        "E-CKPT-002: ckpt/step-00000004/experiment.json is damaged: it is not valid JSON",
    ),
    "experiment.json empty": (
        lambda w: (w / STEP4 / "experiment.json").write_bytes(b""),
        "E-CKPT-002: ckpt/step-00000004/experiment.json is damaged",
    ),
    "experiment.json foreign": (
        lambda w: (w / STEP4 / "experiment.json").write_text("[1, 2]"),
        "E-CKPT-003: ckpt/step-00000004/experiment.json is not a sexpgpu checkpoint's",
    ),
    "experiment.json newer format": (
        lambda w: (w / STEP4 / "experiment.json").write_text('{"format": 7}'),
        "E-CKPT-003: ckpt/step-00000004/experiment.json is format 7, from a newer sexpgpu",
    ),
}


@pytest.mark.parametrize("resume", ["latest", str(STEP4)])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_refused_and_nothing_starts(workdir, damage, resume):
    spoil, expected = DAMAGE[damage]
    spoil(workdir)
    before = _snapshot(workdir)
    line = error_line(refused_in_process(*RUN, "--resume", resume, cwd=workdir))
    assert line.startswith(f"sexpgpu run: {expected}"), line
    # Not a fresh start: no step written, no step trained, no new experiment.
    assert _snapshot(workdir) == before
    assert step_dirs(workdir / "ckpt") == ["step-00000002", "step-00000004"]
    (run_dir,) = experiments(workdir / "m")
    assert max(e["step"] for e in events(run_dir) if e.get("name") == "loss") == 4


def test_a_cut_off_checkpoint_is_passed_over_but_a_damaged_one_before_it_is_refused(workdir):
    # Writing step 4 was cut off before experiment.json: `latest` takes step 2, whose
    # states file is gone, and that is an error rather than a start from nothing.
    (workdir / STEP4 / "experiment.json").unlink()
    (workdir / "ckpt" / "step-00000002" / "states.safetensors").unlink()
    before = _snapshot(workdir)
    line = error_line(refused_in_process(*RUN, "--resume", "latest", cwd=workdir))
    assert line == (
        "sexpgpu run: E-CKPT-002: ckpt/step-00000002/states.safetensors is missing "
        "from the checkpoint; --resume latest never falls back to an older checkpoint: "
        "there is no complete checkpoint before it (move it aside to start afresh)"
    ), line
    assert _snapshot(workdir) == before
    # Asked for by name, the cut-off one is not a checkpoint.
    line = error_line(refused_in_process(*RUN, "--resume", str(STEP4), cwd=workdir))
    assert line.startswith("sexpgpu run: E-CKPT-001: "), line
    assert _snapshot(workdir) == before


def test_resume_locations_that_are_not_there_or_cannot_be_listed(workdir):
    before = _snapshot(workdir)
    line = error_line(refused_in_process(*RUN, "--resume", "ckpt/step-00000009", cwd=workdir))
    assert line == "sexpgpu run: E-CKPT-001: there is no checkpoint at ckpt/step-00000009", line
    no_location = ["run", "my-run.sx", "--metrics-dir", "m", "--resume", "latest"]
    line = error_line(refused_in_process(*no_location, cwd=workdir), 2)
    assert line.startswith("sexpgpu run: E-CKPT-005: --resume latest needs a checkpoint"), line
    (workdir / "afile").write_text("in the way")
    line = error_line(
        run_sexpgpu(*RUN[:2], "--checkpoint-dir", "afile", "--resume", "latest", cwd=workdir)
    )
    assert line.startswith("sexpgpu run: E-STORAGE-004: "), line
    assert _snapshot(workdir) == before
