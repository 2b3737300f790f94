"""Drawn programs resume to the bit from every checkpoint, compiled and eager.

Each CI run draws a few programs (``tests/compiled/drawn.py``: optimizer, weight
decay, schedule, clip, guard, dropout, bf16, two stages, a repeat with and without
recompute, a frozen parameter, a cross-entropy or a policy-gradient loss, a second
stage on other data) and a sharded one (2 or 3 ranks, ``:shard full`` or
``optimizer``, with or without a repeat, an uneven table, a scalar) from a seed
taken from the commit, so every commit tries other ones and a failure names the seed
that makes it again. Each program also draws the machine profile its processes
start with (``tests/profiles.py``: one thread, torch's default count with nothing
set, two threads on a lower ATen capability). Each program
trains uninterrupted with a checkpoint after every step; each checkpoint is resumed
in a new process, and every later checkpoint must hold the uninterrupted run's bytes. Each program's eval pass
reports the same numbers to the bit in the run, in every resumed run and in
`sexpgpu evaluate --follow`. ``scripts/sweep_resume.py`` runs the whole sweep.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.compiled.drawn import Drawn, check_resumes, draw, draw_sharded, sexpgpu_runner
from tests.profiles import profile_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
COUNT = int(os.environ.get("SEXPGPU_DRAWN_PROGRAMS", "1"))
"""Programs drawn per lowering in one run of the suite."""


def _commit_seed() -> int:
    """A seed that changes with each commit (0 outside a git checkout)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=30
        ).stdout.strip()
        return int(head[:8], 16) if head else 0
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


SEED = int(os.environ.get("SEXPGPU_DRAWN_SEED", _commit_seed()))


@pytest.mark.parametrize("lowering", ["compiled", "torch"])
@pytest.mark.parametrize("index", range(COUNT))
def test_a_drawn_program_resumes_to_the_bit_from_every_checkpoint(
    lowering: str, index: int, tmp_path: Path, compiled_env: dict[str, str]
):
    # the two lowerings try different programs
    drawn = draw(SEED + index + (0 if lowering == "compiled" else 1_000_003), lowering=lowering)
    _check(drawn, lowering, tmp_path, compiled_env)


@pytest.mark.parametrize("index", range(COUNT))
def test_a_drawn_sharded_program_resumes_to_the_bit_from_every_checkpoint(
    index: int, tmp_path: Path, compiled_env: dict[str, str]
):
    _check(draw_sharded(SEED + index + 2_000_003), "torch", tmp_path, compiled_env)


def _check(drawn: Drawn, lowering: str, folder: Path, env: dict[str, str]) -> None:
    run = sexpgpu_runner(profile_env(drawn.profile, env))
    differences = check_resumes(drawn, folder, lowering=lowering, run=run)
    assert not differences, (
        f"{drawn.name()} (SEXPGPU_DRAWN_SEED={drawn.seed}):\n"
        + "\n".join(differences)
        + "\n"
        + drawn.source
    )
