"""Fixtures for the :load tests: a work folder, and the loopback S3 and GCS servers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_REPO = str(Path(__file__).resolve().parents[2])
if _REPO not in sys.path:  # so that `tests.servers` imports however pytest was started
    sys.path.insert(0, _REPO)

from tests.e2e_storage.conftest import (  # noqa: E402,F401
    bucket,
    gcs_bucket_name,
    s3,
    s3_bucket_name,
)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """An empty project folder."""
    folder = tmp_path / "project"
    folder.mkdir()
    return folder
