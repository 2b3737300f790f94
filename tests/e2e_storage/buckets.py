"""Reading what a run left in a bucket, straight through boto3 / google-cloud-storage."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.e2e.helpers import sexpgpu_env
from tests.servers import S3_ISOLATION

# Settings of the user running the tests that would reach past the loopback servers.
_UNSET = (
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "SEXPGPU_CHECKPOINT_PROFILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "SEXPGPU_CHECKPOINT_GOOGLE_CREDENTIALS",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "STORAGE_EMULATOR_HOST",
    "SEXPGPU_CHECKPOINT_DIR",
    "SEXPGPU_RESUME",
)

CHECKPOINT_FILES = ("experiment.json", "params.safetensors", "state.json", "states.safetensors")


def s3_admin_client(endpoint: str, key: str = "testing", secret: str = "testing") -> Any:
    """A boto3 S3 client for ``endpoint`` that ignores the environment."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        region_name="us-east-1",
    )


def gcs_admin_client(endpoint: str) -> Any:
    """A google-cloud-storage client for the emulator at ``endpoint``."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(
        project="sexpgpu-test",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": endpoint},
    )


@dataclass
class Bucket:
    """A bucket on a loopback server, as the tests see it."""

    scheme: str  # "s3" or "gs"
    name: str
    endpoint: str
    home: Path
    key: str = "testing"
    secret: str = "testing"

    def env(self, *, endpoint: str | None = None, **extra: str) -> dict[str, str]:
        """The environment of a `sexpgpu` subprocess that reaches this bucket's server
        (or ``endpoint``, a proxy in front of it) with test credentials only."""
        env = sexpgpu_env()
        for name in _UNSET:
            env.pop(name, None)
        if self.scheme == "s3":
            env.update(S3_ISOLATION)
            env.update(
                {
                    "AWS_CONFIG_FILE": str(self.home / "aws-config"),
                    "AWS_SHARED_CREDENTIALS_FILE": str(self.home / "aws-credentials"),
                    "AWS_EC2_METADATA_DISABLED": "true",
                    "AWS_ENDPOINT_URL_S3": endpoint or self.endpoint,
                }
            )
        else:
            env.update(
                {
                    "STORAGE_EMULATOR_HOST": endpoint or self.endpoint,
                    "GOOGLE_CLOUD_PROJECT": "sexpgpu-test",
                }
            )
        env.update(extra)
        return env

    def uri(self, prefix: str) -> str:
        """``s3://name/prefix`` or ``gs://name/prefix``."""
        return f"{self.scheme}://{self.name}/{prefix}"

    def objects(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix/`` (key relative to it) and its size."""
        start = prefix.rstrip("/") + "/"
        if self.scheme == "s3":
            client = s3_admin_client(self.endpoint, self.key, self.secret)
            found = {}
            for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=self.name, Prefix=start
            ):
                for item in page.get("Contents", []):
                    found[item["Key"][len(start) :]] = item["Size"]
            return found
        client = gcs_admin_client(self.endpoint)
        return {
            blob.name[len(start) :]: blob.size
            for blob in client.list_blobs(self.name, prefix=start)
        }

    def read(self, key: str) -> bytes:
        """One object's bytes."""
        if self.scheme == "s3":
            client = s3_admin_client(self.endpoint, self.key, self.secret)
            return client.get_object(Bucket=self.name, Key=key)["Body"].read()
        return gcs_admin_client(self.endpoint).bucket(self.name).blob(key).download_as_bytes()

    def complete_steps(self, prefix: str) -> list[str]:
        """The ``step-<n>`` folders under ``prefix`` that hold ``experiment.json``."""
        return sorted(
            key.split("/")[0]
            for key in self.objects(prefix)
            if key.endswith("/experiment.json") and key.startswith("step-")
        )

    def tensors(self, step_prefix: str) -> dict[str, dict[str, tuple]]:
        """Every tensor's dtype, shape and raw bytes in a checkpoint's two tensor files."""
        from safetensors.numpy import load

        result = {}
        for name in ("params.safetensors", "states.safetensors"):
            arrays = load(self.read(f"{step_prefix}/{name}"))
            result[name] = {k: (str(v.dtype), v.shape, v.tobytes()) for k, v in arrays.items()}
        return result

    def json(self, key: str) -> dict:
        """A JSON object's content."""
        return json.loads(self.read(key))


def assert_same_tensors(a: dict, b: dict) -> None:
    """Two :meth:`Bucket.tensors` results hold the same tensors, byte for byte."""
    assert sorted(a) == sorted(b)
    for name in a:
        assert sorted(a[name]) == sorted(b[name]), f"{name}: different tensors"
        assert a[name], f"{name}: no tensors"
        for key in a[name]:
            assert a[name][key] == b[name][key], f"{name}:{key} differs"


def said(stderr: str) -> list[str]:
    """What `sexpgpu` told the user on stderr: its lines less the JSON log records
    (the tests run it with ``SEXPGPU_LOG_FORMAT=json``)."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("{")]
