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

import structlog

# Whole words of a key only, so a counter named `tokens` is not taken for a secret.
_SECRET_KEY = re.compile(
    r"(?:^|[_\-.])(secret|token|password|passwd|credentials?|access_key|api_key|session_key|private_key)(?:$|[_\-.])",
    re.I,
)
_configured = False


def _masked(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: "***" if _SECRET_KEY.search(str(k)) else _masked(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_masked(v) for v in value)
    return value


def _mask_secrets(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    for key in list(event):
        if key == "event":
            continue
        event[key] = "***" if _SECRET_KEY.search(key) else _masked(event[key])
    return event


class _Stderr:
    """The current ``sys.stderr`` (tests and a terminal display may replace it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure(level: str = "info", fmt: str = "auto", stream: Any = None) -> None:
    """Set up structlog once per process: ``fmt`` is ``console``, ``json`` or ``auto``
    (console on a terminal, JSON otherwise). Without ``stream`` lines go to the
    current ``sys.stderr``."""
    global _configured
    stream = stream or _Stderr()
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer(sort_keys=False)
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
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
            if hasattr(logging, "getLevelNamesMapping")
            else getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str = "sexpgpu", **context: Any) -> Any:
    """A structlog logger, ``context`` on each line, configured as at each call (defaults first)."""
    if not _configured:
        configure()
    return structlog.get_logger(name, **context)
