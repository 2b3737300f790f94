"""Checkpoint locations in Google Cloud Storage (gs://bucket/prefix), through google-cloud-storage."""

from __future__ import annotations

from sexpgpu.hookspecs import hookimpl
from sexpgpu.plugins import module_missing


@hookimpl
def sexpgpu_unavailable():
    return module_missing("google.cloud.storage", "pip install 'sexpgpu[gcs]'")


@hookimpl
def sexpgpu_storage_backends():
    return []
