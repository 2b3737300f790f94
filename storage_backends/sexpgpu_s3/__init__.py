"""Checkpoint locations in S3 and S3-compatible stores (s3://bucket/prefix), through boto3."""

from __future__ import annotations

from sexpgpu.extension import Storage, StorageBackendInfo, module_missing
from sexpgpu.hookspecs import hookimpl


def _open(uri: str) -> Storage:
    # boto3 is imported only here, when an s3:// location is opened.
    from sexpgpu_s3.backend import S3Storage

    return S3Storage(uri)


@hookimpl
def sexpgpu_unavailable():
    return module_missing("boto3", "pip install 'sexpgpu[s3]'")


@hookimpl
def sexpgpu_storage_backends() -> list[StorageBackendInfo]:
    """The ``s3`` scheme: ``s3://bucket/prefix`` through boto3's standard configuration."""
    return [
        StorageBackendInfo(
            schemes=("s3",),
            factory=_open,
            doc="s3://bucket/prefix; credentials and endpoint from boto3's standard "
            "configuration, SEXPGPU_CHECKPOINT_PROFILE for a checkpoint profile",
        )
    ]
