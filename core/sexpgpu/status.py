"""The status file: where a run is, in one small JSON file a person or a scheduler can read.

``<metrics-dir>/<slug>/status.json`` holds ``state`` (``running``,
``interrupted``, ``finished`` or ``failed``), ``summary`` (the state, or
``failed: <error>``), ``error``, ``step``, ``checkpoint`` (the last
checkpoint's location or ``null``), ``slug`` and ``updated`` (unix seconds).
Every write replaces the whole file atomically (temporary file, fsync,
rename), so a reader never sees half of one. A run killed outright writes
nothing more: its file keeps reading ``running``.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["STATES", "STATUS_FILE", "StatusFile", "run_identity"]

STATES = ("running", "interrupted", "finished", "failed")
"""The values of ``state``."""

STATUS_FILE = "status.json"
"""The file's name in ``<metrics-dir>/<slug>/``."""


class StatusFile:
    """Writes a run's status file; cheap enough to call from the step loop.

    :meth:`update` changes fields and writes at once (start, checkpoint, end);
    :meth:`progress` records the step and writes at most once every
    ``min_interval`` seconds. A write that fails (a full disk) is logged and
    does not stop the run: the status file reports on a run, it is not the run.
    Every method may be called from any thread (the checkpoint writer reports
    a stored checkpoint while the step loop records steps).
    """

    def __init__(self, path: str | os.PathLike[str], *, min_interval: float = 1.0) -> None:
        self.path = Path(path)
        self.min_interval = min_interval
        self.fields: dict[str, Any] = {
            "state": "running",
            "summary": "running",
            "error": None,
            "step": 0,
            "checkpoint": None,
            "slug": self.path.parent.name,
            "updated": None,
        }
        self._last_write = float("-inf")
        self.unwritten: str | None = None
        """Why the last write failed (a full disk); ``None`` once one succeeds."""
        # Re-entrant: update() and progress() hold it around _write().
        self._lock = threading.RLock()

    def update(self, **fields: Any) -> bool:
        """Set ``fields`` and write the file now. Returns whether the write succeeded.

        ``state`` must be one of :data:`STATES`; ``summary`` follows it
        (``failed: <error>`` for ``failed``) and ``error`` is cleared when the
        state is not ``failed``. Other keys (``steps``, ``tokens``...) are kept
        as given; every value must be JSON-able. Raises :class:`ValueError` for
        an unknown state.
        """
        if "state" in fields and fields["state"] not in STATES:
            raise ValueError(
                f"unknown run state {fields['state']!r}; expected one of {', '.join(STATES)}"
            )
        with self._lock:
            self.fields.update(fields)
            state = self.fields["state"]
            error = (self.fields.get("error") or "unknown error") if state == "failed" else None
            self.fields["error"] = error
            self.fields["summary"] = f"failed: {error}" if error else state
            return self._write()

    def progress(self, step: int, **fields: Any) -> bool:
        """Record that the run is at ``step``; write only if the last write is at
        least ``min_interval`` seconds old. Returns whether it wrote."""
        with self._lock:
            self.fields["step"] = int(step)
            self.fields.update(fields)
            if time.monotonic() - self._last_write < self.min_interval:
                return False
            return self._write()

    def _write(self) -> bool:
        self.fields["updated"] = time.time()
        data = json.dumps(self.fields, indent=1, sort_keys=False) + "\n"
        # One temporary name per process is enough: writes are serialised by the lock.
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data.encode("utf-8"))
                f.flush()
                # fsync before the rename: after a crash the file is the old
                # one or the new one, never an empty one.
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            if self.unwritten is None:
                from sexpgpu.log import get_logger

                get_logger("sexpgpu.status").warning(
                    "cannot write the status file",
                    path=str(self.path),
                    error=exc.strerror or str(exc),
                )
            self.unwritten = exc.strerror or str(exc)
            return False
        self._last_write = time.monotonic()
        self.unwritten = None
        return True


def run_identity(file: str, program: Any, choices: Mapping[str, Any]) -> dict[str, Any]:
    """What the status file says about the run itself, for ``program`` (a compiled
    :class:`sexpgpu.lang.ir.Program`) from ``file``: `sexpgpu runs` lists it, a sink
    (mlflow) names and describes the run with it, and ``pid``/``host`` tell a reader
    whether a ``running`` run still has its process."""
    import socket

    from sexpgpu.checkpoint.records import jsonable

    return {
        "run": program.run.name,
        "file": file,
        "steps": program.steps,
        "variant": program.variant or "-",
        "knobs": {k.name: jsonable(k.value) for k in program.knobs},
        "choices": {site: str(choice) for site, choice in sorted(choices.items())},
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
    }
