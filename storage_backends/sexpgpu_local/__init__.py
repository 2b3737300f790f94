"""Checkpoint locations on a local or mounted file system (plain paths and file://)."""

from __future__ import annotations

from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_storage_backends():
    return []
