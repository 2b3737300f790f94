"""The TensorBoard sink: listed unavailable with its hint when tensorboard is missing,
and, where it is installed, event files TensorBoard itself reads back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sexpgpu.metrics import MetricsStream, open_sinks

# What a machine without tensorboard sees: the module blocked in a fresh interpreter.
WITHOUT_TENSORBOARD = """
import json, sys
sys.modules["tensorboard"] = None
from sexpgpu.errors import SexpError
from sexpgpu.metrics import open_sinks
from sexpgpu.plugins import get_plugins
record = get_plugins().record("tensorboard")
names = [info.name for info in get_plugins().available("sexpgpu_metrics_sinks")]
try:
    open_sinks(["tensorboard"], sys.argv[1], "exp")
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
        stream = MetricsStream(open_sinks(["tensorboard"], str(tmp_path), slug), experiment=slug)
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
