"""The metrics stream: points, annotations and ``done``, delivered to sinks off the step loop.

A run reports into one *experiment*, named by its slug (:func:`new_slug`, kept
in ``experiment.json`` so a resume reports into the same one). The run loop
calls :meth:`MetricsStream.point`, :meth:`MetricsStream.annotation` and
:meth:`MetricsStream.done`; each call builds one event and queues it for every
sink, and returns at once. One background thread per sink delivers its queue in
batches, so a slow sink delays neither the step loop nor the other sinks, and a
failing one is retried with backoff and logged, never raised into the run.
:meth:`MetricsStream.close` drains the queues, up to a timeout, at the end of a
run or on a signal, and says how many events did not get through.

Delivery is at least once: a batch whose ``write`` raised after storing part of
it is written again, so a collector deduplicates by the event's ``id``.
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

RESERVED_KEYS = frozenset({"kind", "id", "experiment", "step", "time", "name", "value", "text"})
"""Keys the stream sets itself; an annotation's extra fields may not use them."""

_GRACE = 1.0  # seconds close() gives a sink's thread to leave write() once abandoned

_SLUG_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def new_slug(file_stem: str) -> str:
    """A new experiment name: ``file_stem`` plus a short random suffix (``my-run-3f9a1c``).

    Characters that do not belong in a folder or URL path are replaced by
    ``-``, so the slug is safe as ``<metrics-dir>/<slug>`` and in any sink.
    """
    stem = _SLUG_UNSAFE.sub("-", file_stem).strip("-.") or "run"
    return f"{stem}-{secrets.token_hex(3)}"


def open_sinks(
    names: Sequence[str], metrics_dir: str, slug: str, catalog: Catalog
) -> list[MetricsSink]:
    """Open the sinks named by ``--metrics-sink`` for experiment ``slug``.

    Each name is looked up in ``catalog`` (a name given twice opens once). Raises :class:`sexpgpu.errors.PluginError` for a name no
    available plugin supplies, with the install hint when an unavailable one
    does, and :class:`sexpgpu.errors.RunError` when a sink cannot be opened; the
    sinks opened before the failing one are closed again.
    """
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
                reason = exc.strerror or str(exc)
                where = exc.filename or metrics_dir
                raise RunError(
                    redact(f"the metrics sink '{name}' cannot be opened: {where}: {reason}")
                ) from None
    except BaseException:
        for sink in opened:
            with contextlib.suppress(Exception):  # failing already: the first error is reported
                sink.close()
        raise
    return opened


def _number(value: Any) -> int | float:
    # An int stays an int (counters such as tokens); anything else numeric
    # (a numpy or torch scalar, a bool) becomes a plain float or int for JSON.
    if type(value) is int:
        return value
    if isinstance(value, bool):
        return int(value)
    return float(value)


def _error_line(exc: BaseException) -> str:
    # A sink's error may quote its URI, credentials and all (a tracking server's
    # user:password@): they are masked before the line is logged or kept.
    from sexpgpu.checkpoint.storage import redact

    return redact(f"{type(exc).__name__}: {exc}".splitlines()[0])


class _SinkWorker:
    """One sink's queue and the thread that delivers it."""

    def __init__(
        self,
        sink: MetricsSink,
        label: str,
        *,
        experiment: str,
        max_batch: int,
        linger: float,
        backoff: tuple[float, float],
    ) -> None:
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
        self.delivered = 0
        self.failures = 0
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
            self.delivered += size
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
                self.failures += 1
                self.last_error = _error_line(exc)
                # Log the first failure of a batch and then every tenth, so a
                # sink that is down for an hour does not flood the log.
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
    """The metrics stream of one experiment, fanned out to ``sinks``.

    The producer methods (:meth:`point`, :meth:`annotation`, :meth:`done`) only
    build an event and append it to each sink's queue: they never wait for a
    sink, and they may be called from any thread. ``max_batch`` bounds one ``write`` call; ``linger`` is how long a
    sink's thread waits for more events before writing a batch (well under a
    second); ``backoff`` is the first and the longest pause between retries of a
    failing write.
    """

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
            _SinkWorker(
                sink,
                f"{i}:{sink.name}",
                experiment=experiment,
                max_batch=max_batch,
                linger=linger,
                backoff=backoff,
            )
            for i, sink in enumerate(with_defaults(s, MetricsSink) for s in sinks)
        ]
        self.undelivered_by_sink: dict[str, int] = {}
        """After :meth:`close`: each sink's label and how many events it did not get."""
        self.errors_by_sink: dict[str, str] = {}
        """After :meth:`close`: each sink short of events, and its last write's error."""

    # -- producing

    def _emit(self, event: dict[str, Any]) -> dict[str, Any]:
        # The lock makes the producer methods safe from several threads (the step
        # loop and the checkpoint writer): the count stays exact and no event
        # slips in between close() deciding to drain and draining.
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
        clash = RESERVED_KEYS.intersection(fields)
        if clash:  # a bug in the caller, not a user error
            raise ValueError(f"{kind} fields may not be named {sorted(clash)}")
        return {
            "kind": kind,
            "id": uuid.uuid4().hex,
            "experiment": self.experiment,
            "step": int(step),
            "time": time.time(),
        }

    def point(self, step: int, name: str, value: float, /, **fields: Any) -> dict[str, Any]:
        """Queue a point: ``name`` (``loss``, ``eval/accuracy``, ``tokens``) had ``value`` at ``step``.

        Returns the event. ``value`` may be NaN or infinite; a sink decides how
        to store it. ``fields`` are JSON-able extras (``source="evaluate"``), never
        one of :data:`RESERVED_KEYS` (a :class:`ValueError`).
        """
        event = {**self._event("point", step, fields), **fields}
        return self._emit({**event, "name": str(name), "value": _number(value)})

    def annotation(self, step: int, text: str, /, **fields: Any) -> dict[str, Any]:
        """Queue an annotation at ``step``: a line of ``text`` and JSON-able ``fields``
        (``seconds=1.25`` for a checkpoint), named as :meth:`point` allows. Returns the event."""
        event = self._event("annotation", step, fields)
        return self._emit({**event, "text": str(text), **fields})

    def done(self, step: int) -> dict[str, Any]:
        """Queue ``done``: the run ended normally at ``step``. Returns the event."""
        return self._emit(self._event("done", step, {}))

    # -- draining

    def pending(self) -> int:
        """Events queued or being written, summed over the sinks (for progress and tests)."""
        return sum(worker.undelivered() for worker in self._workers)

    def close(self, timeout: float | None = None) -> int:
        """Drain the queues and close the sinks; returns how many events were not delivered.

        Waits until every sink has taken every event, or until ``timeout``
        seconds have passed (``None`` waits as long as it takes). The result
        counts the events that at least one sink did not get (0 when all got
        through); :attr:`undelivered_by_sink` has the count per sink, and each
        sink short of events is logged. A sink that is still stuck in a write is
        left to its (daemon) thread and not closed; every other sink is closed.
        Calling ``close`` again returns 0.
        """
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
            # A thread backing off or waiting ends at once now; one inside
            # write() gets a short grace, then is left alone: closing the sink
            # under a write would race with it.
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
