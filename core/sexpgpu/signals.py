"""Stopping a run at a step boundary on SIGTERM, SIGINT or SIGHUP.

Until the step loop starts there is nothing to save, so the first signal
interrupts at once (a long compile or data load exits promptly). Once the
loop runs, the first signal only raises a flag that the loop reads at the next
step boundary. A second SIGTERM or SIGINT ends the process at once; a SIGHUP
never does, because a machine shutting down sends SIGTERM and SIGHUP together.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_FATAL_ON_SECOND = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
    """Raised during setup when a signal arrives before the first step.

    A BaseException so that no ``except Exception`` in library code swallows it.
    """

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class StopWatch:
    """Holds the first stopping signal received and decides what later ones do."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.raise_now = True
        self._previous: dict[int, object] = {}
        self._terminating = False
        self._lock = threading.Lock()

    @property
    def name(self) -> str | None:
        """The first signal's name (``SIGTERM``), or ``None`` when none came."""
        return signal.Signals(self.signum).name if self.signum is not None else None

    @property
    def stopping(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        """Take over the three signals (main thread only)."""
        for signum in HANDLED:
            self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        """Give the signals back to whoever had them."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def loop_started(self) -> None:
        """From now on a first signal only asks the loop to stop at the next boundary."""
        self.raise_now = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        with self._lock:
            first = self.signum is None
            if first:
                self.signum = signum
            elif (
                self.signum == signal.SIGHUP
                and signum in _FATAL_ON_SECOND
                and not self._terminating
            ):
                # SIGTERM and SIGHUP together (a machine shutting down) arrive in
                # either order; the stop is reported as the SIGTERM.
                self.signum = signum
            # Only a repeated SIGTERM/SIGINT is fatal: SIGTERM and SIGHUP arriving
            # together, in either order, is one clean stop.
            fatal = signum in _FATAL_ON_SECOND and self._terminating
            if signum in _FATAL_ON_SECOND:
                self._terminating = True
        if fatal:
            # Ends at once, without draining or writing anything more.
            os._exit(128 + signum)
        if not first:
            return
        if self.raise_now:
            raise Interrupted(signum)
