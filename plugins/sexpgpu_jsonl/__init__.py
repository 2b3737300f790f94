"""The embedded default metrics sink: one JSON object per line in <metrics-dir>/<slug>/events.jsonl."""

from __future__ import annotations

from sexpgpu.extension import MetricsSinkInfo
from sexpgpu.hookspecs import hookimpl


def _open(metrics_dir: str, slug: str):
    from sexpgpu_jsonl.sink import JsonlSink

    return JsonlSink(metrics_dir, slug)


def _location(metrics_dir: str, slug: str) -> str:
    from sexpgpu_jsonl.sink import events_path

    return str(events_path(metrics_dir, slug))


@hookimpl
def sexpgpu_metrics_sinks() -> list[MetricsSinkInfo]:
    """The ``jsonl`` sink (the default of ``--metrics-sink``)."""
    return [
        MetricsSinkInfo(
            name="jsonl",
            factory=_open,
            doc="appends every event as one JSON line to <metrics-dir>/<slug>/events.jsonl",
            location=_location,
        )
    ]
