"""The status file: where a run is, in one small JSON file (its fields: docs/metrics.md)."""

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

STATES = ("running", "interrupted", "finished", "failed")  # the values of `state`
STATUS_FILE = "status.json"  # in <metrics-dir>/<slug>/


class StatusFile:
    """Writes a run's status file, from any thread (the checkpoint writer's too). A failed
    write is logged once and does not stop the run: it reports on a run, it is not the run."""

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
        self.unwritten: str | None = None  # why the last write failed; None once one succeeds
        self._lock = threading.RLock()

    def update(self, **fields: Any) -> bool:
        """Set ``fields`` (JSON-able; ``state`` one of :data:`STATES`, else a ValueError) and
        write now; ``summary`` and ``error`` follow ``state``. Returns whether it wrote."""
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
        """Record ``step``; write if the last write is ``min_interval`` s old. Returns if it did."""
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
                # fsync before the rename: after a crash, the old file or the new, never empty
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            reason = exc.strerror or str(exc)
            if self.unwritten is None:
                from sexpgpu.log import get_logger

                log = get_logger("sexpgpu.status")
                log.warning("cannot write the status file", path=str(self.path), error=reason)
            self.unwritten = reason
            return False
        self._last_write = time.monotonic()
        self.unwritten = None
        return True


def run_identity(file: str, program: Any, choices: Mapping[str, Any]) -> dict[str, Any]:
    """What the status file says about the run itself (``program`` compiled from ``file``),
    for `sexpgpu runs` and the sinks that name a run."""
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
