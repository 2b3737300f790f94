"""The runs under a metrics folder, from their status files and the tails of their event files.

Listing never reads a whole ``events.jsonl``: the status file says where a run is,
the first line of the events says when it first started, and the last few
hundred kilobytes give the last loss and eval numbers. Hundreds of runs list in
well under a second (``benchmarks/bench_runs.py``).
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sexpgpu_report.fields import MOST_PID, number, open_regular, seconds, text, whole

__all__ = ["RunRow", "list_runs", "process_state", "read_row", "resolve_run"]

STATUS_FILE = "status.json"
EVENTS_FILE = "events.jsonl"
TAIL_FIRST = 64 * 1024  # bytes read from the end of events.jsonl at first
TAIL_MOST = 1024 * 1024  # ... doubled while no loss turned up, up to this
HEAD = 4096  # bytes read from the start for the first event's time
MOST_STATUS_BYTES = 1024 * 1024  # a status file is a few hundred bytes: more is no status

# A point's name as the line spells it, escapes and all, without decoding the line:
# most tail lines are skipped unparsed. ("/" is never escaped, so it tells an eval
# metric; the name itself is the decoded line's.)
_POINT_NAME = re.compile(r'"kind":\s*"point".*?"name":\s*"((?:[^"\\]|\\.)*)"')


@dataclass
class RunRow:
    """One run as ``sexpgpu runs`` lists it (``--json`` prints these fields)."""

    slug: str
    folder: str
    state: str
    """``running``, ``interrupted``, ``finished``, ``failed`` or ``unknown`` (an unreadable status file)."""
    process: str
    """For a ``running`` run: ``alive``, ``gone`` (its process no longer exists: killed
    outright) or ``unknown`` (another host, or a status file without a pid); else ``-``."""
    run: str | None = None
    file: str | None = None
    step: int | None = None
    steps: int | None = None
    loss: float | None = None
    evals: dict[str, float] = field(default_factory=dict)
    """The newest value of each eval metric (``probe/accuracy``) found in the tail."""
    checkpoint: str | None = None
    error: str | None = None
    started: float | None = None
    """Unix seconds of the run's first event (its first start, across resumes)."""
    updated: float | None = None

    def as_json(self) -> dict[str, Any]:
        """The row as JSON-able data."""
        return asdict(self)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open_regular(path) as f:
            raw = f.read(MOST_STATUS_BYTES + 1)
        data = json.loads(raw) if len(raw) <= MOST_STATUS_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _head_time(path: Path) -> float | None:
    """The ``time`` of the first event in ``path``, or ``None``."""
    try:
        with open_regular(path) as f:
            first = f.read(HEAD).split(b"\n", 1)[0]
        value = json.loads(first).get("time")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return seconds(value)


def _tail_lines(path: Path, size: int) -> tuple[list[bytes], bool]:
    """The whole lines in the last ``size`` bytes of ``path``, and whether that was all of it."""
    with open_regular(path) as f:
        f.seek(0, os.SEEK_END)
        length = f.tell()
        start = max(0, length - size)
        f.seek(start)
        data = f.read(length - start)
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]  # the first one is cut
    return [line for line in lines if line], start == 0


def scan_tail(path: Path) -> tuple[float | None, dict[str, float]]:
    """The last training loss and the newest value of each eval metric in the tail of ``path``."""
    size = TAIL_FIRST
    while True:
        try:
            lines, whole = _tail_lines(path, size)
        except OSError:
            return None, {}
        loss: float | None = None
        evals: dict[str, float] = {}
        taken: set[str] = set()  # the eval names read already, as the lines spell them
        for raw in reversed(lines):
            line = raw.decode("utf-8", "replace")
            match = _POINT_NAME.search(line)
            if match is None:
                continue
            spelt = match.group(1)
            if not ((spelt == "loss" and loss is None) or ("/" in spelt and spelt not in taken)):
                continue
            try:
                event = json.loads(line)
            except (ValueError, RecursionError):
                continue  # a torn line, or one nested past reading
            if not isinstance(event, dict):
                continue
            name, value = event.get("name"), number(event.get("value"))
            if value is None or not isinstance(name, str):
                continue
            if name == "loss" and loss is None and "source" not in event:
                loss = value
            elif "/" in name and name not in evals:
                evals[name] = value
                taken.add(spelt)
        if loss is not None or whole or size >= TAIL_MOST:
            return loss, dict(sorted(evals.items()))
        size *= 2


def _proc_start(pid: int) -> float | None:
    """Unix seconds when process ``pid`` started (Linux ``/proc``), or ``None``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        with open("/proc/stat", "rb") as f:
            boot = next(
                float(line.split()[1])
                for line in f.read().decode().splitlines()
                if line.startswith("btime ")
            )
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":  # a zombie: dead, not yet reaped
            return -1.0
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def process_state(status: dict[str, Any], *, host: str | None = None) -> str:
    """``alive``, ``gone`` or ``unknown`` for the process a ``running`` status file names.

    Only a process on this host can be looked at. A pid that exists but started
    after the run did is another process that took the number: the run's is gone.
    """
    pid, where = whole(status.get("pid"), MOST_PID), status.get("host")
    started = seconds(status.get("started"))
    if not pid or where != (host or socket.gethostname()):
        return "unknown"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        pass  # someone else's process: it exists
    except OSError:
        return "unknown"
    began = _proc_start(pid)
    if began is not None and (began < 0 or (started is not None and began > started + 2.0)):
        return "gone"
    return "alive"


def read_row(folder: Path, *, host: str | None = None) -> RunRow | None:
    """The row of the run in ``folder``, or ``None`` when it has no status file."""
    status_path = folder / STATUS_FILE
    if not status_path.is_file():
        return None
    status = _read_json(status_path)
    bad = "no JSON object" if status is None else _unreadable_field(status)
    if status is None or bad is not None:
        return RunRow(
            slug=folder.name,
            folder=str(folder),
            state="unknown",
            process="-",
            error=f"unreadable {STATUS_FILE}: {bad}",
        )
    state = text(status.get("state")) or "unknown"
    events = folder / EVENTS_FILE
    loss, evals = scan_tail(events) if events.is_file() else (None, {})
    started = _head_time(events) if events.is_file() else None
    if started is None:
        started = seconds(status.get("started"))
    return RunRow(
        slug=text(status.get("slug")) or folder.name,
        folder=str(folder),
        state=state,
        process=process_state(status, host=host) if state == "running" else "-",
        run=text(status.get("run")),
        file=text(status.get("file")),
        step=whole(status.get("step")),
        steps=whole(status.get("steps")),
        loss=loss,
        evals=evals,
        checkpoint=text(status.get("checkpoint")),
        error=text(status.get("error")),
        started=started,
        updated=seconds(status.get("updated")),
    )


# What each field of a status file may hold (absent or null aside).
_STATUS_FIELDS = {
    **dict.fromkeys(("state", "slug", "run", "file", "checkpoint", "error", "host"), text),
    **dict.fromkeys(("step", "steps"), whole),
    **dict.fromkeys(("started", "updated"), seconds),
    "pid": lambda value: whole(value, MOST_PID),
}


def _unreadable_field(status: dict[str, Any]) -> str | None:
    """What is wrong with ``status`` (a field no run writes), or ``None``."""
    for key, read in _STATUS_FIELDS.items():
        value = status.get(key)
        if value is not None and read(value) is None:
            return f"'{key}' is {_kind(value)}"
    return None


def _kind(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    if isinstance(value, (bool, str)):
        return "a bool" if isinstance(value, bool) else "text"
    return "out of range"


def _folders(metrics_dir: Path) -> Iterator[Path]:
    try:
        entries = list(os.scandir(metrics_dir))
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.is_dir():
            yield Path(entry.path)


def list_runs(metrics_dir: str | os.PathLike[str]) -> list[RunRow]:
    """Every run under ``metrics_dir``, newest first (by first start, then last update).

    Raises :class:`NotADirectoryError` or :class:`PermissionError` for a folder that
    cannot be listed; a folder that does not exist has no runs.
    """
    host = socket.gethostname()
    rows = [row for f in _folders(Path(metrics_dir)) if (row := read_row(f, host=host))]
    rows.sort(key=lambda r: (r.started or r.updated or 0.0, r.updated or 0.0), reverse=True)
    return rows


def resolve_run(run: str, metrics_dir: str | os.PathLike[str]) -> Path | None:
    """The folder ``run`` names: a run folder (with a status or events file), or a slug
    under ``metrics_dir``; ``None`` when neither exists."""
    for candidate in (Path(run), Path(metrics_dir) / run):
        if (candidate / STATUS_FILE).is_file() or (candidate / EVENTS_FILE).is_file():
            return candidate
    return None
