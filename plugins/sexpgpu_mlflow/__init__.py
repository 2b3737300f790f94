"""An MLflow metrics sink (needs ``pip install 'sexpgpu[mlflow]'``).

``--metrics-sink mlflow`` reports a run to the tracking server ``MLFLOW_TRACKING_URI``
names: the ``.sx`` run's name is the MLflow experiment, the sexpgpu experiment
(the slug) one MLflow run, found again by its tag when the run is resumed.
"""

from __future__ import annotations

from sexpgpu.extension import MetricsSinkInfo, module_missing
from sexpgpu.hookspecs import hookimpl

HINT = "pip install 'sexpgpu[mlflow]'"


def _open(metrics_dir: str, slug: str):
    from sexpgpu_mlflow.sink import MlflowSink

    return MlflowSink(metrics_dir, slug)


@hookimpl
def sexpgpu_unavailable() -> str | None:
    """Unavailable, with the install hint, when the ``mlflow`` package is missing."""
    return module_missing("mlflow", HINT)


@hookimpl
def sexpgpu_metrics_sinks() -> list[MetricsSinkInfo]:
    """The ``mlflow`` sink."""
    return [
        MetricsSinkInfo(
            name="mlflow",
            factory=_open,
            doc="points as metrics, annotations as tags and the run's note, on MLFLOW_TRACKING_URI",
        )
    ]
