"""Fixtures for the evaluation tests: a project folder holding the small eval run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

EVAL_SX = Path(__file__).with_name("eval.sx")


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A temp folder holding ``eval.sx``, as a user's project would."""
    shutil.copy(EVAL_SX, tmp_path / "eval.sx")
    return tmp_path
