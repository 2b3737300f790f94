"""The embedded default metrics sink: one JSON object per line in <metrics-dir>/<slug>/events.jsonl."""

from __future__ import annotations

from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_metrics_sinks():
    return []
