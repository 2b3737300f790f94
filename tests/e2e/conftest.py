"""Fixtures for end-to-end tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .helpers import EXAMPLES


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A temp folder holding copies of the examples, as a user's project would."""
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    return tmp_path
