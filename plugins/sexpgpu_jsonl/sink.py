"""The JSONL sink and a reader for what it writes."""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from sexpgpu.extension import MetricsSink

EVENTS_FILE = "events.jsonl"


def events_path(metrics_dir: str | os.PathLike[str], slug: str) -> Path:
    """Where the JSONL sink writes experiment ``slug``: ``<metrics-dir>/<slug>/events.jsonl``."""
    return Path(metrics_dir) / slug / EVENTS_FILE


def _strict(value: Any) -> Any:
    # Strict JSON has no NaN or Infinity (jq and most parsers refuse Python's
    # tokens), so a non-finite float is written as the string Python's
    # float() reads back: "NaN", "Infinity", "-Infinity".
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, Mapping):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def encode_event(event: Mapping[str, Any]) -> bytes:
    """One event as one line of strict JSON (UTF-8, ending in a newline)."""
    try:
        text = json.dumps(event, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError):
        # A non-finite number or a value JSON does not know (a Path): rare,
        # so only then pay for walking the event.
        text = json.dumps(
            _strict(event), separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=str
        )
    return text.encode("utf-8") + b"\n"


class JsonlSink(MetricsSink):
    """Appends events to ``<metrics-dir>/<slug>/events.jsonl``, one write per batch.

    The file is opened for appending, so a resumed run (same slug) adds to the
    same file. Each batch is one ``write`` on an ``O_APPEND`` descriptor, so it
    is in the file (visible to ``tail -f``) when ``write`` returns, and lines
    from two processes reporting into one experiment never interleave.

    Before each batch the sink checks that the path still names the file it
    has open: a file removed or replaced (a folder cleaned up mid-run, the file
    swapped for another) would otherwise take events into a file nobody can
    read, with every write succeeding. It then opens the path again, and a
    folder that cannot take the file any more makes ``write`` raise, so the
    stream warns and counts the events as undelivered.
    """

    name = "jsonl"

    def __init__(self, metrics_dir: str | os.PathLike[str], slug: str) -> None:
        self.path = events_path(metrics_dir, slug)
        self._fd: int | None = None
        self._open()

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            # A run killed in the middle of a write leaves a torn last line:
            # end it, so the next event starts a line of its own and only the
            # torn one is unreadable.
            size = os.fstat(fd).st_size
            if size:
                with open(self.path, "rb") as f:
                    f.seek(size - 1)
                    if f.read(1) != b"\n":
                        os.write(fd, b"\n")
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def write(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Append ``events`` as lines; raises :class:`OSError` when the file cannot take them."""
        if self._fd is not None and not self._still_ours():
            self._drop()
            _warn("the metrics file was removed or replaced; opening it again", self.path)
        if self._fd is None:
            # The last write failed part way, or the file went: start again on a fresh line.
            self._open()
        data = memoryview(b"".join(encode_event(e) for e in events))
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except BaseException:
            self._drop()
            raise

    def _still_ours(self) -> bool:
        """Whether the path still names the open file (same device and inode)."""
        try:
            opened = os.fstat(self._fd)
        except OSError:
            return True  # a descriptor gone bad: the write raises and is retried
        try:
            named = os.stat(self.path)
        except OSError:
            return False
        return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)

    def _drop(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        """Make the file durable (fsync) and close it."""
        if self._fd is None:
            return
        try:
            os.fsync(self._fd)
        finally:
            self._drop()


def _warn(message: str, path: Path) -> None:
    from sexpgpu.log import get_logger

    get_logger("sexpgpu.metrics").warning(message, path=str(path))


MOST_LINE = 1 << 20
"""The longest event line read back (a point is about 200 bytes): a longer one is skipped."""


def read_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The events in a JSONL file, in order, skipping blank, torn and over-long lines.

    The file is read as hostile: :class:`OSError` for anything but a regular file (a
    FIFO would hang the reader, a link to ``/dev/zero`` fill its memory), and a line
    past :data:`MOST_LINE` is skipped a piece at a time. Values written as ``"NaN"``,
    ``"Infinity"`` or ``"-Infinity"`` are given back as strings; ``float()`` turns
    them into numbers.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{os.fspath(path)} is not a regular file")
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        while raw := f.readline(MOST_LINE + 1):
            if len(raw) > MOST_LINE and not raw.endswith(b"\n"):
                while (rest := f.readline(MOST_LINE)) and not rest.endswith(b"\n"):
                    pass  # the rest of an over-long line, a piece at a time
                continue
            line = raw.strip()
            if not line:
                continue
            try:
                event = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(event, dict):
                yield event
