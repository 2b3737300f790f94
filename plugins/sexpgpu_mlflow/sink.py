"""The MLflow sink: a sexpgpu experiment as one MLflow run, through ``MlflowClient``.

Nothing talks to the server before the first ``write``: a server that is down
at the start is retried as it is later, by the stream, and never stops the run.
What the run is (its ``.sx`` run's name, knobs and choices) comes from the status
file, which the run writes before its first event.

MLflow's own HTTP retries (minutes, by default) are turned down to none unless
``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` is set: the stream retries a failed batch
itself, with backoff, and a write stuck for minutes would hold the batches
queued behind it.

The tracking URI may hold credentials (``http://user:secret@host``): every message
the sink makes or passes on, the ``mlflow run`` log line and each failed write's
error, shows it with them replaced by ``***``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from sexpgpu.checkpoint.storage import redact
from sexpgpu.errors import RunError
from sexpgpu.extension import MetricsSink

__all__ = ["MlflowSink", "MlflowWriteError", "SLUG_TAG", "annotation_tag"]

SLUG_TAG = "sexpgpu.slug"
"""The tag that holds the slug: a resumed run finds its MLflow run by it."""
NOTE_TAG = "mlflow.note.content"  # the run's description in MLflow's UI (markdown)
STATUS_FILE = "status.json"
TAG_LIMIT = 8000  # MLflow's longest tag value
PER_CALL = 100  # MLflow takes at most 100 params or tags, 1000 metrics, in one log_batch

# An annotation's first words -> the MLflow status it leaves the run in.
TERMINAL = (("interrupted by ", "KILLED"), ("failed: ", "FAILED"))
_SUFFIX = re.compile(r"-[0-9a-f]{6}$")
_BASE_KEYS = ("kind", "id", "experiment", "step", "time", "text")
EVALUATE = "evaluate"  # the `source` of the points `sexpgpu evaluate` reports


def _credentials(uri: str) -> str:
    # Everything between the scheme and the last `@`: the user and password, even
    # when the password holds an `@` or a `/` that the URL did not percent-encode,
    # and in a URI with no scheme (`_masked` replaces them as the client quotes them).
    _, marker, rest = uri.partition("://")
    return (rest if marker else uri).rpartition("@")[0]


def _masked(text: str, *uris: str) -> str:
    # ``text`` with each URI's own credentials replaced wherever they turn up (a
    # client may quote the URI or decode it), then those of any other URL, as storage
    # messages have them: `http://user:secret@host` -> `http://***@host`.
    for uri in uris:
        secret = _credentials(uri)
        for form in {secret, unquote(secret)} - {""}:
            text = text.replace(f"{form}@", "***@")
    return redact(text)


def _same(value: float) -> Any:
    # NaN equals no NaN: a key under which two NaNs at one step are the same point
    return "nan" if math.isnan(value) else value


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


class MlflowWriteError(Exception):
    """A write the tracking server did not take: the client's error as one line, with
    the tracking URI's credentials replaced by ``***``. The stream logs it and retries."""


def annotation_tag(event: Mapping[str, Any]) -> tuple[str, str]:
    """An annotation as a tag: ``annotation.<step, 8 digits>.<id's first 8>`` and its
    text, then one ``key: value`` line per field."""
    lines = [str(event.get("text", ""))]
    lines += [f"{k}: {json.dumps(v, default=str)}" for k, v in event.items() if k not in _BASE_KEYS]
    key = f"annotation.{int(event.get('step', 0)):08d}.{str(event.get('id', ''))[:8]}"
    return key, "\n".join(lines)[:TAG_LIMIT]


def _note_lines(event: Mapping[str, Any]) -> list[str]:
    text = "done" if event.get("kind") == "done" else str(event.get("text", ""))
    return [f"step {int(event.get('step', 0))}: {line}" for line in text.splitlines() or [""]]


def _terminal(event: Mapping[str, Any]) -> str | None:
    if event.get("kind") == "done":
        return "FINISHED"
    text = str(event.get("text", ""))
    return next((status for prefix, status in TERMINAL if text.startswith(prefix)), None)


class MlflowSink(MetricsSink):
    """Points become metrics at their step, annotations tags (and lines of the run's
    note), knobs and choices params (``knob.lr``, ``choice.<site>``); ``done``,
    ``interrupted by`` and ``failed:`` set the MLflow run's status, ``resumed from``
    sets it running again."""

    name = "mlflow"

    def __init__(self, metrics_dir: str | os.PathLike[str], slug: str) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        # MLflow prints the run's URL on stdout when it ends; the log says it instead
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._Metric, self._Param, self._RunTag = Metric, Param, RunTag
        self._MlflowException = MlflowException
        configured = os.environ.get("MLFLOW_TRACKING_URI", "")
        try:
            # no request yet: a URI MLflow cannot take (an unknown scheme) fails here
            self.client = MlflowClient()
        except Exception as exc:
            where = f"MLFLOW_TRACKING_URI={configured}" if configured else "MLflow's default"
            text = f"{where}: {_reason(exc)}"
            raise RunError(
                f"the metrics sink 'mlflow' cannot be opened: {_masked(text, configured)}"
            ) from None
        # the URI as set and as MLflow resolved it: each one's credentials are masked
        self._uris = (self.client.tracking_uri or configured, configured)
        self.slug = slug
        self.status_path = Path(metrics_dir) / slug / STATUS_FILE
        self.run_id: str | None = None
        self._note: list[str] = []  # the note's lines the server has
        self._sent: set[str] = set()  # ids of this batch already logged (a retried batch)

    # -- finding or making the run

    def _identity(self) -> dict[str, Any]:
        try:
            with open(self.status_path, encoding="utf-8") as f:
                status = json.load(f)
        except (OSError, ValueError):
            return {}
        return status if isinstance(status, dict) else {}

    def _experiment_id(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except self._MlflowException:
            found = self.client.get_experiment_by_name(name)  # made meanwhile by another run
            if found is None:
                raise
            return found.experiment_id

    def _find(self, experiments: list[str]) -> Any:
        found = self.client.search_runs(
            experiments, filter_string=f"tags.`{SLUG_TAG}` = '{self.slug}'", max_results=1
        )
        return found[0] if found else None

    def _find_anywhere(self) -> tuple[Any, str]:
        # Without the status file (`sexpgpu evaluate` on another machine or with
        # another --metrics-dir) the experiment's name is unknown: the slug's stem is
        # the file's, which need not be the run's. The tag finds the run wherever it is.
        token = None
        while True:
            page = self.client.search_experiments(max_results=1000, page_token=token)
            names = {e.experiment_id: e.name for e in page}
            ids = list(names)
            for start in range(0, len(ids), PER_CALL):
                run = self._find(ids[start : start + PER_CALL])
                if run is not None:
                    return run, names[run.info.experiment_id]
            token = page.token
            if not token:
                return None, ""

    def _locate(self, identity: Mapping[str, Any]) -> tuple[Any, str]:
        # (the run, None when there is none yet; its experiment's name)
        if identity.get("run"):
            name = str(identity["run"])
            return self._find([self._experiment_id(name)]), name
        run, name = self._find_anywhere()
        return run, name or _SUFFIX.sub("", self.slug)

    def _open_run(self) -> None:
        identity = self._identity()
        run, name = self._locate(identity)
        found = run is not None
        if run is None:
            tags = {SLUG_TAG: self.slug}
            tags.update(
                {f"sexpgpu.{k}": str(identity[k]) for k in ("file", "variant") if k in identity}
            )
            experiment = self._experiment_id(name)
            run = self.client.create_run(experiment, run_name=self.slug, tags=tags)
        params = {f"knob.{k}": v for k, v in (identity.get("knobs") or {}).items()}
        params.update({f"choice.{k}": v for k, v in (identity.get("choices") or {}).items()})
        # A param cannot change in MLflow: a knob changed on resume keeps its first
        # value there, and the `resumed from` annotation says what moved.
        new = [
            self._Param(key, str(value)[:6000])
            for key, value in params.items()
            if key not in run.data.params
        ]
        for start in range(0, len(new), PER_CALL):
            self.client.log_batch(run.info.run_id, params=new[start : start + PER_CALL])
        note = run.data.tags.get(NOTE_TAG, "")
        self._note = [line for line in note.split("  \n") if line]
        self.run_id = run.info.run_id
        from sexpgpu.log import get_logger

        get_logger("sexpgpu.mlflow").info(
            "mlflow run",
            experiment=name,
            run_id=self.run_id,
            tracking_uri=_masked(self._uris[0], *self._uris),
            found=found,
        )

    # -- the sink

    def write(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Log ``events`` to the MLflow run (made or found on the first call); raises
        :class:`MlflowWriteError` when the server does not take them."""
        try:
            self._write(events)
        except Exception as exc:
            # the stream logs the error's line: the client's names the URI in full
            line = f"{type(exc).__name__}: {_reason(exc)}"
            raise MlflowWriteError(_masked(line, *self._uris)) from None

    def _write(self, events: Sequence[Mapping[str, Any]]) -> None:
        if self.run_id is None:
            self._open_run()
        assert self.run_id is not None
        metrics: list[tuple[str, Any]] = []
        evaluations: list[tuple[str, Any]] = []
        tags: list[tuple[str, Any]] = []
        lines: list[str] = []
        status: str | None = None
        for event in events:
            kind, ident = event.get("kind"), str(event.get("id", ""))
            if kind == "point":
                metric = self._Metric(
                    key=str(event["name"]),
                    value=float(event["value"]),  # also reads "NaN"
                    timestamp=int(float(event.get("time", 0)) * 1000),
                    step=int(event.get("step", 0)),
                )
                evaluated = event.get("source") == EVALUATE
                (evaluations if evaluated else metrics).append((ident, metric))
                continue
            if kind == "annotation":
                tags.append((ident, self._RunTag(*annotation_tag(event))))
                if str(event.get("text", "")).startswith("resumed from "):
                    status = "RUNNING"
            lines += _note_lines(event)
            status = _terminal(event) or status
        metrics += self._not_logged(evaluations)
        self._log(metrics, 1000, "metrics")
        self._log(tags, PER_CALL, "tags")
        if lines:
            note = self._note + lines
            text = "  \n".join(note)  # markdown: a hard break keeps one line per line
            self.client.set_tag(self.run_id, NOTE_TAG, text[-TAG_LIMIT:])
            self._note = note
        if status == "RUNNING":
            self.client.update_run(self.run_id, status="RUNNING")
        elif status is not None:
            self.client.set_terminated(self.run_id, status=status)
        self._sent.clear()

    def _not_logged(self, points: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """The points of ``points`` whose metric has no equal value at their step yet.

        `sexpgpu evaluate` run again on a checkpoint (a second evaluate, a follower
        restarted in the repeat case) reports the same numbers again, and MLflow
        keeps no event ids: a metric, step and value it already holds (from the run's
        own pass too) is the same point, and is not logged twice.
        """
        held: dict[str, set[tuple[int, Any]]] = {}
        todo = []
        for ident, metric in points:
            if metric.key not in held:
                history = self.client.get_metric_history(self.run_id, metric.key)
                held[metric.key] = {(m.step, _same(m.value)) for m in history}
            point = (metric.step, _same(metric.value))
            if point not in held[metric.key]:
                held[metric.key].add(point)
                todo.append((ident, metric))
        return todo

    def _log(self, items: list[tuple[str, Any]], per_call: int, what: str) -> None:
        # A batch given again after a failure skips what already got through, so
        # a metric's history has no point twice.
        todo = [(ident, item) for ident, item in items if ident not in self._sent]
        for start in range(0, len(todo), per_call):
            chunk = todo[start : start + per_call]
            self.client.log_batch(self.run_id, **{what: [item for _, item in chunk]})
            self._sent.update(ident for ident, _ in chunk)

    def close(self) -> None:
        """Nothing to flush: every ``write`` is on the server when it returns."""
