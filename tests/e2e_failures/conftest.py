"""A trained run to damage: each test gets its own copy of one run trained once."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.e2e.helpers import EXAMPLES, run_sexpgpu

from .kit import RESUME_RUN


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """examples/my-run.sx trained for 4 steps: checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("trained")
    shutil.copy(EXAMPLES / "my-run.sx", root / "my-run.sx")
    result = run_sexpgpu(*RESUME_RUN[:-2], "--steps", "4", cwd=root)
    assert result.returncode == 0, result.stderr
    return root


@pytest.fixture
def workdir(trained: Path, tmp_path: Path) -> Path:
    """A copy of the trained run to damage (links copied as links)."""
    shutil.copytree(trained, tmp_path / "w", symlinks=True)
    return tmp_path / "w"
