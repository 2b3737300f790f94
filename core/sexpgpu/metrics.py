"""The metrics stream: points, annotations and ``done``, delivered to sinks off the step loop.

Each event is queued per sink and the call returns at once; one thread per sink writes
its queue in batches, retrying a failing write with backoff, never raising into the run.
Delivery is at least once (docs/metrics.md#delivery): a collector deduplicates by ``id``.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sexpgpu.errors import RunError, SexpError
from sexpgpu.extension import MetricsSink, MetricsSinkInfo, with_defaults

if TYPE_CHECKING:
    from sexpgpu.catalog import Catalog

__all__ = ["RESERVED_KEYS", "MetricsStream", "new_slug", "open_sinks"]

# Keys the stream sets itself; an event's extra fields may not use them.
RESERVED_KEYS = frozenset({"kind", "id", "experiment", "step", "time", "name", "value", "text"})

_GRACE = 1.0  # seconds close() gives a sink's thread to leave write() once abandoned

_SLUG_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def new_slug(file_stem: str) -> str:
    """A new experiment name: ``file_stem`` plus a short random suffix (``my-run-3f9a1c``),
    with ``-`` for what does not belong in a folder or URL path."""
    stem = _SLUG_UNSAFE.sub("-", file_stem).strip("-.") or "run"
    return f"{stem}-{secrets.token_hex(3)}"


def open_sinks(
    names: Sequence[str], metrics_dir: str, slug: str, catalog: Catalog
) -> list[MetricsSink]:
    """Open the sinks ``names`` (each once) from ``catalog`` for experiment ``slug``; raises
    ``PluginError`` for a name no available plugin supplies and ``RunError`` for a sink that
    cannot be opened, after closing those opened before it."""
    from sexpgpu.checkpoint.storage import redact

    opened: list[MetricsSink] = []
    try:
        for name in dict.fromkeys(names):
            info: MetricsSinkInfo = catalog.metrics_sink(name)
            try:
                opened.append(info.factory(metrics_dir, slug))
            except SexpError:
                raise
            except OSError as exc:
                where = f"{exc.filename or metrics_dir}: {exc.strerror or exc}"
                error = f"the metrics sink '{name}' cannot be opened: {where}"
                raise RunError(redact(error)) from None
    except BaseException:
        for sink in opened:
            with contextlib.suppress(Exception):  # failing already: the first error is reported
                sink.close()
        raise
    return opened


def _number(value: Any) -> int | float:
    # An int stays an int (counters such as tokens) and a bool becomes one; anything else
    # numeric (a numpy or torch scalar) becomes a plain float, for JSON.
    return int(value) if type(value) in (int, bool) else float(value)


def _error_line(exc: BaseException) -> str:
    # A sink's error may quote its URI, credentials and all (a tracking server's
    # user:password@): they are masked before the line is logged or kept.
    from sexpgpu.checkpoint.storage import redact

    return redact(f"{type(exc).__name__}: {exc}".splitlines()[0])


class _SinkWorker:
    """One sink's queue and the thread that delivers it."""

    def __init__(
        self, sink: MetricsSink, label: str, experiment: str, max_batch: int, linger: float,
        backoff: tuple[float, float],
    ) -> None:  # fmt: skip
        from sexpgpu.log import get_logger

        self.sink = sink
        self.label = label
        self.log = get_logger("sexpgpu.metrics", sink=label, experiment=experiment)
        self.max_batch = max_batch
        self.linger = linger
        self.backoff_first, self.backoff_max = backoff
        # deque.append and popleft are atomic, so the producer takes no lock.
        self.pending: deque[dict[str, Any]] = deque()
        self.in_flight = 0
        self.last_error: str | None = None
        self.wake = threading.Event()
        self.stopping = threading.Event()  # close() was called: stop lingering
        self.abandon = threading.Event()  # close() gave up: stop retrying
        self.thread = threading.Thread(
            target=self._run, name=f"sexpgpu-metrics-{label}", daemon=True
        )
        self.thread.start()

    def put(self, event: dict[str, Any]) -> None:
        self.pending.append(event)
        if not self.wake.is_set():
            self.wake.set()

    def undelivered(self) -> int:
        return len(self.pending) + self.in_flight

    def _run(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            if not self.pending:
                if self.stopping.is_set():
                    return
                continue
            if not self.stopping.is_set() and len(self.pending) < self.max_batch:
                # Wait a little for more events so a fast loop is written in
                # batches; short enough that `tail -f` still shows a live run.
                self.stopping.wait(self.linger)
            # Count the batch in flight before taking it off the queue, so
            # close() may over-count for an instant but never under-count.
            size = min(len(self.pending), self.max_batch)
            self.in_flight = size
            batch = [self.pending.popleft() for _ in range(size)]
            if not self._deliver(batch):
                return
            self.in_flight = 0
            # More may be left (a batch is bounded), or close() may be waiting.
            self.wake.set()

    def _deliver(self, batch: list[dict[str, Any]]) -> bool:
        delay = self.backoff_first
        attempt = 0
        while True:
            attempt += 1
            try:
                self.sink.write(batch)
            except Exception as exc:  # a sink must never take the run down
                self.last_error = _error_line(exc)
                # The first failure of a batch and every tenth: a sink down for hours is no flood.
                if attempt == 1 or attempt % 10 == 0:
                    self.log.warning(
                        "metrics sink write failed; retrying",
                        events=len(batch),
                        attempt=attempt,
                        retry_in=round(delay, 3),
                        error=self.last_error,
                    )
                if self.abandon.wait(delay):
                    return False
                delay = min(delay * 2, self.backoff_max)
                continue
            if attempt > 1:
                self.log.info("metrics sink recovered", attempts=attempt)
            return True


class MetricsStream:
    """The metrics stream of one experiment, fanned out to ``sinks``; producing never waits
    for a sink, from any thread. ``max_batch`` bounds one ``write``; ``linger`` is how long a
    sink's thread waits for more events; ``backoff``, the first and the longest retry pause."""

    def __init__(
        self,
        sinks: Sequence[MetricsSink],
        *,
        experiment: str,
        max_batch: int = 1000,
        linger: float = 0.2,
        backoff: tuple[float, float] = (0.1, 5.0),
    ) -> None:
        self.experiment = experiment
        self.emitted = 0
        self._closed = False
        self._close_lock = threading.Lock()
        self._workers = [
            _SinkWorker(sink, f"{i}:{sink.name}", experiment, max_batch, linger, backoff)
            for i, sink in enumerate(with_defaults(s, MetricsSink) for s in sinks)
        ]
        # After close(): each sink's label and how many events it did not get; and each
        # sink short of events, with its last write's error.
        self.undelivered_by_sink: dict[str, int] = {}
        self.errors_by_sink: dict[str, str] = {}

    def _emit(self, event: dict[str, Any]) -> dict[str, Any]:
        # The lock makes producing safe from several threads (step loop, checkpoint writer): the
        # count stays exact, and no event slips in between close() deciding to drain and draining.
        with self._close_lock:
            if not self._closed:
                self.emitted += 1
                for worker in self._workers:
                    worker.put(event)
                return event
        from sexpgpu.log import get_logger

        # A late event (say from a `finally` after a signal) is dropped:
        # raising here could turn a clean stop into a crash.
        get_logger("sexpgpu.metrics").warning(
            "metrics event after the stream was closed; dropped",
            kind=event["kind"],
            step=event["step"],
        )
        return event

    def _event(self, kind: str, step: int, fields: dict[str, Any]) -> dict[str, Any]:
        if clash := RESERVED_KEYS.intersection(fields):  # a bug in the caller, not a user error
            raise ValueError(f"{kind} fields may not be named {sorted(clash)}")
        return {
            "kind": kind,
            "id": uuid.uuid4().hex,
            "experiment": self.experiment,
            "step": int(step),
            "time": time.time(),
        }

    def point(self, step: int, name: str, value: float, /, **fields: Any) -> dict[str, Any]:
        """Queue a point: ``name`` (``loss``, ``tokens``) had ``value`` (maybe NaN) at ``step``;
        ``fields`` are JSON-able extras, none in :data:`RESERVED_KEYS`. Returns the event."""
        event = {**self._event("point", step, fields), **fields}
        return self._emit({**event, "name": str(name), "value": _number(value)})

    def annotation(self, step: int, text: str, /, **fields: Any) -> dict[str, Any]:
        """Queue an annotation: ``text`` at ``step``, ``fields`` as for a point; returns it."""
        event = self._event("annotation", step, fields)
        return self._emit({**event, "text": str(text), **fields})

    def done(self, step: int) -> dict[str, Any]:
        """Queue ``done``: the run ended normally at ``step``. Returns the event."""
        return self._emit(self._event("done", step, {}))

    def pending(self) -> int:
        """Events queued or being written, summed over the sinks (for progress and tests)."""
        return sum(worker.undelivered() for worker in self._workers)

    def close(self, timeout: float | None = None) -> int:
        """Drain the queues for up to ``timeout`` seconds (``None``: as long as it takes) and
        close the sinks, except one stuck in a write; returns how many events at least one
        sink did not get (per sink: :attr:`undelivered_by_sink`). A second call returns 0."""
        with self._close_lock:
            if self._closed:
                return 0
            self._closed = True
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        for worker in self._workers:
            worker.stopping.set()
            worker.wake.set()
        for worker in self._workers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            worker.thread.join(left)
        missing = 0
        for worker in self._workers:
            worker.abandon.set()
            worker.wake.set()
            count = worker.undelivered()
            self.undelivered_by_sink[worker.label] = count
            if count and worker.last_error:
                self.errors_by_sink[worker.label] = worker.last_error
            missing = max(missing, count)
            # A thread backing off or waiting ends at once now; one inside write() gets a
            # short grace, then is left alone: closing the sink under a write would race it.
            worker.thread.join(_GRACE)
            if worker.thread.is_alive():
                worker.log.warning("metrics sink did not finish; left open", undelivered=count)
                continue
            if count:
                worker.log.warning("metrics events not delivered", undelivered=count)
            try:
                worker.sink.close()
            except Exception as exc:
                worker.log.warning("metrics sink failed to close", error=_error_line(exc))
        return missing

    def __enter__(self) -> MetricsStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
