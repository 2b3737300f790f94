"""Structured logging for the CLI and the run loop (structlog).

Readable lines on a terminal, one JSON object per line with ``--log-format
json``. Values under keys that look like secrets are masked wherever they are
logged from.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

# Whole words of a key only, so a counter named `tokens` is not taken for a secret.
_SECRET_KEY = re.compile(
    r"(?:^|[_\-.])(secret|token|password|passwd|credentials?|access_key|api_key|session_key|private_key)(?:$|[_\-.])",
    re.I,
)
_configured = False


def _masked(value: Any, key: str = "") -> Any:
    if _SECRET_KEY.search(key):
        return "***"
    if isinstance(value, dict):
        return {k: _masked(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_masked(v) for v in value)
    return value


def _mask_secrets(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    return {key: value if key == "event" else _masked(value, key) for key, value in event.items()}


class _Stderr:
    """The current ``sys.stderr`` (tests and a terminal display may replace it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


# structlog (and the rich it imports) costs a command that logs nothing ~0.1 s: it is
# set up at the first line logged, as last configured (after a reset: the defaults)
_pending: dict[str, Any] | None = None
_applied: dict[str, Any] = {}


def configure(level: str = "info", fmt: str = "auto", stream: Any = None) -> None:
    """Set how lines are written from the next one on: ``fmt`` ``console``, ``json`` or ``auto``
    (console on a terminal), to ``stream`` or else the current ``sys.stderr``."""
    global _pending, _configured
    _pending, _configured = {"level": level, "fmt": fmt, "stream": stream}, False


def show_from(level: str) -> None:
    """Show only lines at ``level`` or above from now on, written as configured."""
    configure(**{**(_pending or _applied), "level": level})


def _apply(level: str = "info", fmt: str = "auto", stream: Any = None) -> None:
    import structlog

    global _configured, _applied
    _applied = {"level": level, "fmt": fmt, "stream": stream}
    stream = stream or _Stderr()
    if fmt == "json" or (fmt == "auto" and not stream.isatty()):  # auto: console on a terminal
        renderer: Any = structlog.processors.JSONRenderer(sort_keys=False)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=stream.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _mask_secrets,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str = "sexpgpu", **context: Any) -> Any:
    """A structlog logger, ``context`` on each line, configured as at each call (defaults first)."""
    import structlog

    global _pending
    if not _configured:
        _apply(**(_pending or {}))
        _pending = None
    return structlog.get_logger(name, **context)
