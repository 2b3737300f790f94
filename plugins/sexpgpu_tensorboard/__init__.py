"""A TensorBoard metrics sink (needs ``pip install 'sexpgpu[tensorboard]'``).

Writes ``<metrics-dir>/<slug>/tensorboard/events.out.tfevents.*`` with
TensorBoard's own event-file writer; torch's ``SummaryWriter`` is not used.
"""

from __future__ import annotations

from sexpgpu.extension import MetricsSinkInfo, module_missing
from sexpgpu.hookspecs import hookimpl

HINT = "pip install 'sexpgpu[tensorboard]'"


def _open(metrics_dir: str, slug: str):
    from sexpgpu_tensorboard.sink import TensorBoardSink

    return TensorBoardSink(metrics_dir, slug)


@hookimpl
def sexpgpu_unavailable() -> str | None:
    """Unavailable, with the install hint, when the ``tensorboard`` package is missing."""
    return module_missing("tensorboard", HINT)


@hookimpl
def sexpgpu_metrics_sinks() -> list[MetricsSinkInfo]:
    """The ``tensorboard`` sink."""
    return [
        MetricsSinkInfo(
            name="tensorboard",
            factory=_open,
            doc="points as scalars and annotations as text in <metrics-dir>/<slug>/tensorboard",
        )
    ]
