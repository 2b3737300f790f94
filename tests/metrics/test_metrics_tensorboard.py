"""The TensorBoard sink: listed unavailable with its hint when tensorboard is missing,
and, where it is installed, event files TensorBoard itself reads back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sexpgpu.metrics import MetricsStream, open_sinks
from tests.catalogs import project

# What a machine without tensorboard sees: the module blocked in a fresh interpreter.
WITHOUT_TENSORBOARD = """
import json, sys
sys.modules["tensorboard"] = None
from sexpgpu.errors import SexpError
from sexpgpu.catalog import Catalog
from sexpgpu.metrics import open_sinks
catalog = Catalog.load()
record = catalog.record("tensorboard")
names = [info.name for info in catalog.available("sexpgpu_metrics_sinks")]
try:
    open_sinks(["tensorboard"], sys.argv[1], "exp", catalog)
    opened = "opened"
except SexpError as exc:
    opened = str(exc)
print(json.dumps({"available": record.available, "reason": record.reason,
                  "hooks": record.hooks, "sinks": names, "open": opened}))
"""


def test_without_tensorboard_listed_unavailable_with_the_install_hint(tmp_path):
    child = subprocess.run(
        [sys.executable, "-c", WITHOUT_TENSORBOARD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    seen = json.loads(child.stdout)
    assert seen["available"] is False
    assert seen["reason"] == "tensorboard is not installed: pip install 'sexpgpu[tensorboard]'"
    assert "sexpgpu_metrics_sinks" in seen["hooks"]
    # Its descriptor is still there, so a lookup names the reason instead of "unknown".
    assert "tensorboard" not in seen["sinks"]
    assert seen["open"] == (
        "the metrics sink 'tensorboard' needs the plugin 'tensorboard', which is unavailable: "
        "tensorboard is not installed: pip install 'sexpgpu[tensorboard]'"
    )


def test_points_and_annotations_read_back_by_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sexpgpu_tensorboard.sink import logdir

    slug = "my-run-3f9a1c"
    for steps in ([1, 2], [3]):  # a resumed run adds a second event file
        stream = MetricsStream(
            open_sinks(["tensorboard"], str(tmp_path), slug, project()), experiment=slug
        )
        for step in steps:
            stream.point(step, "loss", 1.0 / step)
        stream.annotation(steps[-1], "checkpoint step", seconds=0.5)
        assert stream.close(timeout=None) == 0

    folder = logdir(tmp_path, slug)
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    loss = accumulator.Scalars("loss")
    assert [(s.step, pytest.approx(s.value)) for s in loss] == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    texts = accumulator.Tensors("annotations")
    assert [t.step for t in texts] == [2, 3]
    first = texts[0].tensor_proto.string_val[0].decode()
    assert first.startswith("checkpoint step") and "`seconds`: 0.5" in first


def test_annotations_render_in_tensorboard_one_line_per_line(tmp_path):
    """What TensorBoard's text tab shows, through its own reader and renderer."""
    import re
    from html import unescape

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.text.text_plugin import process_event
    from tensorboard.util.tensor_util import make_ndarray

    from sexpgpu_tensorboard.sink import logdir

    slug = "my-run-3f9a1c"
    text = "resumed from ck/step-00000004\nknob lr 0.5 -> 0.25\nsource my-run.sx changed"
    stream = MetricsStream(
        open_sinks(["tensorboard"], str(tmp_path), slug, project()), experiment=slug
    )
    stream.annotation(4, text, seconds=0.5, blocked=0.01)
    stream.done(6)
    assert stream.close(timeout=None) == 0

    accumulator = EventAccumulator(str(logdir(tmp_path, slug)), size_guidance={"tensors": 0})
    accumulator.Reload()
    shown = []
    for event in accumulator.Tensors("annotations"):
        html = process_event(event.wall_time, event.step, make_ndarray(event.tensor_proto), True)
        # the lines a reader sees: a browser folds a newline into a space, and a
        # break, a paragraph or a list item ends a line
        flat = re.sub(r"\s*\n\s*", " ", html["text"])
        flat = re.sub(r"<br\s*/?>|</p>|</li>", "\n", flat)
        text_seen = unescape(re.sub(r"<[^>]+>", "", flat))
        shown.append([line.strip() for line in text_seen.splitlines()])
    assert [[line for line in lines if line] for lines in shown] == [
        [*text.splitlines(), "seconds: 0.5", "blocked: 0.01"],
        ["done"],
    ]
