"""Opening checkpoint locations through the storage-backend plugins."""

from __future__ import annotations

import re

from sexpgpu.errors import StorageError
from sexpgpu.extension import Storage, StorageBackendInfo

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def scheme_of(uri: str) -> str:
    """The URI scheme of a location; a plain path is ``file``."""
    match = _SCHEME.match(uri)
    return match.group(1).lower() if match else "file"


def open_location(uri: str) -> Storage:
    """Open ``uri`` with the storage backend that serves its scheme.

    Raises :class:`sexpgpu.errors.PluginError` when no available plugin serves
    the scheme (with the install hint when one is installed but unavailable).
    """
    from sexpgpu.plugins import get_plugins

    if not uri:
        raise StorageError("an empty checkpoint location was given")
    scheme = scheme_of(uri)
    backend: StorageBackendInfo = get_plugins().require(
        "sexpgpu_storage_backends",
        f"the location {uri} ({scheme}://)",
        lambda info: scheme in info.schemes,
    )
    return backend.factory(uri)
