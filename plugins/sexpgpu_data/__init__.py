"""Built-in data sources: generated tasks, text and token files, .npy arrays, images."""

from __future__ import annotations

from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_data_sources():
    return []
