"""The TensorBoard sink: event files TensorBoard reads, written without torch."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sexpgpu.extension import MetricsSink

SUBDIR = "tensorboard"
_BASE_KEYS = ("kind", "id", "experiment", "step", "time", "text")


def logdir(metrics_dir: str | os.PathLike[str], slug: str) -> Path:
    """The folder to point ``tensorboard --logdir`` at: ``<metrics-dir>/<slug>/tensorboard``."""
    return Path(metrics_dir) / slug / SUBDIR


def annotation_markdown(event: Mapping[str, Any]) -> str:
    """An annotation as the markdown TensorBoard's text tab shows: its text, then its
    fields, one line per line (a ``resumed from`` annotation has one per moved knob)."""
    lines = str(event.get("text", "")).splitlines() or [""]
    extra = {k: v for k, v in event.items() if k not in _BASE_KEYS}
    if extra:
        lines.append("")
        lines.extend(f"- `{k}`: {json.dumps(v, default=str)}" for k, v in extra.items())
    # Markdown joins single newlines; a hard break keeps one line per line.
    return "  \n".join(lines)


class TensorBoardSink(MetricsSink):
    """Points become scalars (tag = the point's name), annotations text under the
    tag ``annotations``, ``done`` a text ``done``.

    A resumed run opens a new event file in the same folder; TensorBoard reads
    them all as one run.
    """

    name = "tensorboard"

    def __init__(self, metrics_dir: str | os.PathLike[str], slug: str) -> None:
        # Imported here so that listing plugins never imports tensorboard.
        from tensorboard.compat.proto import (
            event_pb2,
            summary_pb2,
            tensor_pb2,
            tensor_shape_pb2,
            types_pb2,
        )
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2 = event_pb2
        self._summary_pb2 = summary_pb2
        self._tensor_pb2 = tensor_pb2
        self._shape_pb2 = tensor_shape_pb2
        self._types_pb2 = types_pb2
        self.logdir = logdir(metrics_dir, slug)
        self.logdir.mkdir(parents=True, exist_ok=True)
        # The stream batches and flushes itself; a long flush_secs keeps the
        # writer's own thread from flushing on its own schedule.
        self._writer = EventFileWriter(str(self.logdir), max_queue_size=1024, flush_secs=3600)
        # The text plugin's metadata: plugin name "text", an empty (version 0) content.
        self._text_metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text", content=b"")
        )

    def _text_value(self, tag: str, text: str) -> Any:
        tensor = self._tensor_pb2.TensorProto(
            dtype=self._types_pb2.DT_STRING,
            string_val=[text.encode("utf-8")],
            tensor_shape=self._shape_pb2.TensorShapeProto(
                dim=[self._shape_pb2.TensorShapeProto.Dim(size=1)]
            ),
        )
        return self._summary_pb2.Summary.Value(tag=tag, metadata=self._text_metadata, tensor=tensor)

    def _summary_event(self, event: Mapping[str, Any]) -> Any:
        kind = event.get("kind")
        if kind == "point":
            # float() also reads the JSONL spelling of non-finite values ("NaN").
            summary_value = self._summary_pb2.Summary.Value(
                tag=str(event["name"]), simple_value=float(event["value"])
            )
        elif kind == "annotation":
            summary_value = self._text_value("annotations", annotation_markdown(event))
        elif kind == "done":
            summary_value = self._text_value("annotations", "done")
        else:
            return None
        return self._event_pb2.Event(
            wall_time=float(event.get("time", 0.0)),
            step=int(event.get("step", 0)),
            summary=self._summary_pb2.Summary(value=[summary_value]),
        )

    def write(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Add every event to the event file and flush it."""
        for event in events:
            proto = self._summary_event(event)
            if proto is not None:
                self._writer.add_event(proto)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()
