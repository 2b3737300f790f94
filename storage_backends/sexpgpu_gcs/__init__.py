"""Checkpoint locations in Google Cloud Storage (gs://bucket/prefix), through google-cloud-storage."""

from __future__ import annotations

from sexpgpu.extension import Storage, StorageBackendInfo, module_missing
from sexpgpu.hookspecs import hookimpl


def _open(uri: str) -> Storage:
    # google.cloud.storage is imported only here, when a gs:// location is opened.
    from sexpgpu_gcs.backend import GcsStorage

    return GcsStorage(uri)


@hookimpl
def sexpgpu_unavailable():
    return module_missing("google.cloud.storage", "pip install 'sexpgpu[gcs]'")


@hookimpl
def sexpgpu_storage_backends() -> list[StorageBackendInfo]:
    """The ``gs`` scheme: ``gs://bucket/prefix`` with application-default credentials."""
    return [
        StorageBackendInfo(
            schemes=("gs",),
            factory=_open,
            doc="gs://bucket/prefix; application-default credentials, "
            "SEXPGPU_CHECKPOINT_GOOGLE_CREDENTIALS for a checkpoint key file, "
            "STORAGE_EMULATOR_HOST for an emulator",
        )
    ]
