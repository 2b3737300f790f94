"""Fixtures for the storage backends: real servers on loopback, fresh locations."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_REPO = str(Path(__file__).resolve().parents[2])
if _REPO not in sys.path:  # so that `tests.servers` imports however pytest was started
    sys.path.insert(0, _REPO)

from tests.servers import (  # noqa: E402,F401
    gcs_env,
    new_bucket_name,
    s3_env,
    unique_prefix,
)


@pytest.fixture(scope="session")
def s3_bucket(moto_s3) -> str:
    """A bucket on the session's moto server, shared by the tests (each uses its own prefix)."""
    import boto3

    name = new_bucket_name("sx-s3")
    client = boto3.client(
        "s3",
        endpoint_url=moto_s3.url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def gcs_bucket(gcs_emulator) -> str:
    """A bucket on the session's GCS emulator, shared by the tests (each uses its own prefix)."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    name = new_bucket_name("sx-gcs")
    client = storage.Client(
        project="sexpgpu-test",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": gcs_emulator.url},
    )
    client.create_bucket(name)
    return name


@pytest.fixture(params=["local", "s3", "gcs"])
def location(request, tmp_path) -> str:
    """A fresh, empty checkpoint location on each backend, its environment set up."""
    if request.param == "local":
        return str(tmp_path / "ckpt")
    if request.param == "s3":
        request.getfixturevalue("s3_env")
        return f"s3://{request.getfixturevalue('s3_bucket')}/{unique_prefix()}"
    request.getfixturevalue("gcs_env")
    return f"gs://{request.getfixturevalue('gcs_bucket')}/{unique_prefix()}"


@pytest.fixture
def store(location):
    """The location opened through the plugins, as the checkpoint layer opens it."""
    from sexpgpu.catalog import Catalog

    return Catalog.load().open_location(location)
