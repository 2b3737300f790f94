"""Checkpoint locations on a local or mounted file system (plain paths and file://)."""

from __future__ import annotations

from sexpgpu.extension import Storage, StorageBackendInfo
from sexpgpu.hookspecs import hookimpl


def _open(uri: str) -> Storage:
    # The backend module is imported only when a location is opened.
    from sexpgpu_local.backend import LocalStorage

    return LocalStorage(uri)


@hookimpl
def sexpgpu_storage_backends() -> list[StorageBackendInfo]:
    """The ``file`` scheme: plain paths and ``file://`` URIs."""
    return [
        StorageBackendInfo(
            schemes=("file",),
            factory=_open,
            doc="a local or mounted folder: /path, ./path or file:///path",
        )
    ]
