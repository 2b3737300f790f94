"""Checkpoint locations in S3 and S3-compatible stores (s3://bucket/prefix), through boto3."""

from __future__ import annotations

from sexpgpu.hookspecs import hookimpl
from sexpgpu.plugins import module_missing


@hookimpl
def sexpgpu_unavailable():
    return module_missing("boto3", "pip install 'sexpgpu[s3]'")


@hookimpl
def sexpgpu_storage_backends():
    return []
