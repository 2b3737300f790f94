"""The TensorBoard sink: listed unavailable with its hint when tensorboard is missing,
and, where it is installed, event files TensorBoard itself reads back."""

from __future__ import annotations

import importlib.util

import pytest

from sexpgpu.metrics import MetricsStream, open_sinks
from sexpgpu.plugins import get_plugins

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@pytest.mark.skipif(HAS_TENSORBOARD, reason="tensorboard is installed here")
def test_listed_unavailable_with_the_install_hint():
    record = get_plugins().record("tensorboard")
    assert record is not None
    assert record.available is False
    assert record.reason == "tensorboard is not installed: pip install 'sexpgpu[tensorboard]'"
    assert "sexpgpu_metrics_sinks" in record.hooks
    # Its descriptor is still there, so a lookup can name the reason.
    assert "tensorboard" not in [
        info.name for info in get_plugins().available("sexpgpu_metrics_sinks")
    ]


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed")
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
