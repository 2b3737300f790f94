"""Fixtures for the checkpoint tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sexpgpu.lang.ir import Program
from tests.catalogs import open_location

from .helpers import make_program

_REPO = str(Path(__file__).resolve().parents[2])
if _REPO not in sys.path:  # so that `tests.servers` imports however pytest was started
    sys.path.insert(0, _REPO)

from tests.servers import new_bucket_name, s3_env  # noqa: E402,F401


@pytest.fixture
def location(tmp_path: Path) -> str:
    """A fresh checkpoint folder."""
    return str(tmp_path / "my-run")


@pytest.fixture
def storage(location: str):
    """The checkpoint folder opened through the real local backend."""
    return open_location(location)


@pytest.fixture
def program() -> Program:
    """The small model of the spec's examples."""
    return make_program()


@pytest.fixture
def s3_bucket(s3_env) -> str:  # noqa: F811 (the fixture imported above)
    """A fresh bucket on the session's moto server, boto3 pointed at it."""
    import boto3

    name = new_bucket_name("sx-ckpt")
    boto3.client("s3").create_bucket(Bucket=name)
    return name
