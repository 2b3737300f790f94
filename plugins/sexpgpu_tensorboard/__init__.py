"""A TensorBoard metrics sink (needs ``pip install 'sexpgpu[tensorboard]'``)."""

from __future__ import annotations

from sexpgpu.hookspecs import hookimpl
from sexpgpu.plugins import module_missing


@hookimpl
def sexpgpu_unavailable():
    return module_missing("tensorboard", "pip install 'sexpgpu[tensorboard]'")


@hookimpl
def sexpgpu_metrics_sinks():
    return []
