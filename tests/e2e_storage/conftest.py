"""Fixtures for bucket end-to-end tests: session-scoped servers and buckets, a work
folder with the examples, and a :class:`Bucket` view that reads objects straight
through the client library (never through sexpgpu), so what the product wrote is
checked independently of the product's own reading code."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.e2e.helpers import EXAMPLES
from tests.e2e_storage.buckets import Bucket, gcs_admin_client, s3_admin_client
from tests.servers import new_bucket_name

SCHEMES = ["s3", "gs"]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A temp folder holding copies of the examples, as a user's project would."""
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    shutil.copy(Path(__file__).with_name("big.sx"), tmp_path / "big.sx")
    return tmp_path


@pytest.fixture(scope="session")
def s3_bucket_name(moto_s3) -> str:
    """A bucket on the session's moto server, shared (each test uses its own prefix)."""
    name = new_bucket_name("sx-e2e")
    s3_admin_client(moto_s3.url).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def gcs_bucket_name(gcs_emulator) -> str:
    """A bucket on the session's GCS emulator, shared (each test uses its own prefix)."""
    name = new_bucket_name("sx-e2e")
    gcs_admin_client(gcs_emulator.url).create_bucket(name)
    return name


@pytest.fixture(scope="session", params=SCHEMES)
def bucket(request, tmp_path_factory) -> Bucket:
    """A shared bucket on s3:// or gs://; ``bucket.env()`` is a `sexpgpu` subprocess's
    environment pointed at its loopback server."""
    home = tmp_path_factory.mktemp("home")
    if request.param == "s3":
        server = request.getfixturevalue("moto_s3")
        return Bucket("s3", request.getfixturevalue("s3_bucket_name"), server.url, home)
    server = request.getfixturevalue("gcs_emulator")
    return Bucket("gs", request.getfixturevalue("gcs_bucket_name"), server.url, home)


@pytest.fixture(scope="session")
def s3(moto_s3, s3_bucket_name, tmp_path_factory) -> Bucket:
    """The shared S3 bucket only."""
    return Bucket("s3", s3_bucket_name, moto_s3.url, tmp_path_factory.mktemp("home"))
