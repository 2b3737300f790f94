"""What a field of a status file or an event may hold, read as hostile input.

Anyone can write a run's ``status.json`` and ``events.jsonl``; a forged or damaged
one must cost its own run's row or point, never the listing or the report. Each
reader here returns the value when it is one sexpgpu writes and ``None`` otherwise,
so a caller never meets a bool taken for a number, a step beyond any run, a time
that cannot be shown or a pid that ``os.kill`` refuses.
"""

from __future__ import annotations

import math
import os
import stat
from typing import IO, Any

MOST_STEPS = 2**63 - 1
"""The largest step or step count (a signed 64-bit integer, as the checkpoint's)."""
MOST_PID = 2**22
"""Linux's largest pid (``pid_max`` can be set no higher)."""
MOST_SECONDS = 1e11
"""Unix seconds past any time a run is reported at (year 5138)."""
MOST_VALUE = 1e300
"""Beyond this a value cannot be drawn (a chart's range would overflow)."""


def whole(value: Any, most: int = MOST_STEPS) -> int | None:
    """``value`` as an integer in ``0..most`` (not a bool), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        return None
    return value


NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
"""The strings the JSON lines sink writes for the values strict JSON has no number for."""


def number(value: Any) -> float | None:
    """``value`` as a float: a JSON number (not a bool), or one of the strings of
    :data:`NON_FINITE`; else ``None``."""
    if isinstance(value, str):
        return NON_FINITE.get(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # a 400-digit integer
        return None


def seconds(value: Any) -> float | None:
    """``value`` as Unix seconds a time can be shown for, else ``None``."""
    found = number(value)
    return found if found is not None and 0.0 <= found <= MOST_SECONDS else None


def drawable(value: Any) -> float | None:
    """``value`` as a number a chart can draw (finite, within ``MOST_VALUE``), else ``None``."""
    found = number(value)
    return (
        found if found is not None and math.isfinite(found) and abs(found) <= MOST_VALUE else None
    )


def text(value: Any) -> str | None:
    """``value`` when it is a string, else ``None``."""
    return value if isinstance(value, str) else None


def shown(value: str) -> str:
    """``value`` safe on a terminal: control and other unprintable characters written
    as Python escapes (``\\x1b``, ``\\n``), so a name cannot move the cursor or
    recolour the screen."""
    if value.isprintable():
        return value
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in value)


def open_regular(path: str | os.PathLike[str]) -> IO[bytes]:
    """``path`` opened for reading in binary when it is a regular file (a link to one
    is followed); :class:`OSError` for anything else, so a FIFO cannot hang a reader
    and a link to ``/dev/zero`` cannot fill its memory."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{os.fspath(path)} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
