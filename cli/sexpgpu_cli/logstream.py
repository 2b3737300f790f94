"""Where the CLI's log lines go: the current ``sys.stderr``, or, while a progress
bar is on the terminal, above it (:func:`redirect`), whole lines at a time."""

from __future__ import annotations

import sys
from collections.abc import Callable

_redirect: Callable[[str], None] | None = None


def redirect(write: Callable[[str], None] | None) -> None:
    """Send each log line (without its newline) to ``write`` instead of stderr, so a
    terminal progress display prints it above itself; ``None`` sends lines back."""
    global _redirect
    _redirect = write


class LogStream:
    """The current ``sys.stderr``, or the :func:`redirect` target, line by line: the
    stream ``sexpgpu`` configures its logging with."""

    def __init__(self) -> None:
        self._partial = ""

    def write(self, text: str) -> int:
        target = _redirect
        if target is None:
            return sys.stderr.write(text)
        # print() writes the message and its newline apart: hand over whole lines.
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            target(line)
        return len(text)

    def flush(self) -> None:
        if _redirect is None:
            sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()
