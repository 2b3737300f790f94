"""Bundles (``NAME.sxb``): one file that replays a run on another machine (DESIGN.md,
"Bundles"). :mod:`~sexpgpu.bundle.archive` is the torch-free on-disk format (a zip
holding ``manifest.json`` and its members); the names below are its public API.
"""

from __future__ import annotations

from sexpgpu.bundle.archive import (
    DEFAULT_BOUND,
    E_DAMAGED,
    E_MANIFEST,
    E_TOO_LARGE,
    E_UNSAFE,
    FORMAT,
    MANIFEST,
    MANIFEST_SCHEMA,
    BundleError,
    describe,
    extract,
    read_manifest,
    unsafe_name,
    write_bundle,
)

__all__ = [
    "DEFAULT_BOUND",
    "E_DAMAGED",
    "E_MANIFEST",
    "E_TOO_LARGE",
    "E_UNSAFE",
    "FORMAT",
    "MANIFEST",
    "MANIFEST_SCHEMA",
    "BundleError",
    "describe",
    "extract",
    "read_manifest",
    "unsafe_name",
    "write_bundle",
]
