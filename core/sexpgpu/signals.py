"""Stopping a run on SIGTERM, SIGINT or SIGHUP, at any moment of the process (docs/signals.md).

Before the step loop a first signal raises :class:`Interrupted` in the main thread (there
is nothing to save); once the loop runs, it asks the loop to stop at the next boundary.
A second SIGTERM or SIGINT ends the process at once (``os._exit``); a SIGHUP never does,
since a machine shutting down sends SIGTERM and SIGHUP together: that pair is one stop.

Why a pipe and a thread: Python runs a handler only between two bytecodes of the main
thread, once however many deliveries came meanwhile, so two SIGTERMs inside one long torch
call would look like one. The C-level handler writes one byte per delivery to the
``signal.set_wakeup_fd`` pipe; a watcher thread reads them, so the second one ends the
process even while the main thread is inside that call (torch releases the GIL).

The console script installs one watch before any heavy import (:func:`watch_process`) and
keeps it until the process exits (:meth:`StopWatch.hold_until_exit`); ``sexpgpu.train.run``
uses it, or installs its own as a library. Only the standard library is imported here,
so that installing is quick.

The handler never raises in the import system (raised in a module lock's weakref callback,
an exception is dropped, or leaves the import lock held): there, and after an Interrupted
was dropped (in a ``__del__``), the watcher sends the signal again.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterable
from types import FrameType

__all__ = ["HANDLED", "Interrupted", "StopWatch", "interruption", "process_watch", "watch_process"]

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # the signals that stop a run
_FATAL_ON_SECOND = (signal.SIGTERM, signal.SIGINT)
PAIR_GRACE = 0.25  # seconds a stop by a SIGHUP alone waits for the SIGTERM sent with it


class Interrupted(BaseException):
    """Raised in the main thread when a signal arrives before the first step (a
    BaseException, so that no ``except Exception`` in library code swallows it)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def interruption(error: BaseException) -> Interrupted | None:
    """The :class:`Interrupted` that ``error`` is or was caused by, if any (Python 3.11
    wraps one raised in a ``__set_name__`` in a ``RuntimeError``: still the signal's)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, Interrupted):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


class StopWatch:
    """Holds the signals received and decides what each one does."""

    def __init__(self) -> None:
        self.raise_now = True
        self._first_fatal: int | None = None  # the first SIGTERM/SIGINT noticed
        self._hup = False
        self._fatal_seen = threading.Event()  # a SIGTERM or SIGINT has been noted
        self._settled: int | None = None
        self._fatal_deliveries = 0  # counted from the pipe: one byte per delivery
        self._raised = False
        self._echoes = 0  # deliveries of our own making (_send_again): not counted
        self._armed = False  # no raise while install() itself runs
        self._ended = False
        self._previous: dict[int, object] = {}
        self._previous_wakeup = -1
        self._previous_unraisable = sys.unraisablehook
        self._fds: tuple[int, ...] = ()
        self._thread: threading.Thread | None = None
        # Re-entrant: the main thread's handler may run while that thread holds it.
        self._lock = threading.RLock()

    @property
    def signum(self) -> int | None:
        """The stop's signal: a SIGTERM or SIGINT over a SIGHUP; ``None`` when none came."""
        if self._settled is not None:
            return self._settled
        if self._first_fatal is not None:
            return self._first_fatal
        return signal.SIGHUP if self._hup else None

    @property
    def name(self) -> str | None:
        """The stop's signal name (``SIGTERM``), or ``None`` when none came."""
        signum = self.signum
        return signal.Signals(signum).name if signum is not None else None

    @property
    def stopping(self) -> bool:
        """Whether a stopping signal has arrived."""
        return self.signum is not None

    def settle(self, grace: float = PAIR_GRACE) -> tuple[str, int]:
        """The stop's signal name and number, fixed from now on; a SIGHUP alone first waits
        up to ``grace`` s for the SIGTERM sent with it (that pair is one stop: SIGTERM)."""
        deadline = time.monotonic() + grace
        while True:
            with self._lock:
                signum = self.signum
                if signum is None:
                    raise RuntimeError("no stopping signal has arrived")
                left = deadline - time.monotonic()
                if signum != signal.SIGHUP or left <= 0:
                    self._settled = signum
                    return signal.Signals(signum).name, signum
            self._fatal_seen.wait(left)

    def loop_started(self) -> None:
        """From now on a first signal only asks the loop to stop at the next boundary."""
        self.raise_now = False

    def ended(self) -> None:
        """The outcome is decided: from now on signals change nothing (and end nothing)."""
        with self._lock:
            self._ended = True

    def hold_until_exit(self) -> None:
        """Ignore the three signals until the process exits (the CLI, at its end): Python
        restores their default action while shutting down, killing a decided process."""
        global _process
        self.ended()
        for signum in HANDLED:
            signal.signal(signum, signal.SIG_IGN)
        if _process is self:
            _process = None

    def install(self, arrived: Iterable[int] = ()) -> None:
        """Take over the three signals (main thread only) and start counting deliveries;
        ``arrived``: those that came before, noted by whoever had them (the console script)."""
        global _installed
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("signals can only be taken in the main thread")
        read_fd, write_fd = os.pipe()
        stop_read, stop_write = os.pipe()
        self._fds = (read_fd, write_fd, stop_read, stop_write)
        for fd in (read_fd, write_fd):
            os.set_blocking(fd, False)  # the interpreter needs a non-blocking wakeup fd
        # The pipe and its reader first: each delivery is counted once the handler is in place.
        self._previous_wakeup = signal.set_wakeup_fd(write_fd)
        _installed = self
        self._thread = threading.Thread(
            target=self._watch, args=(read_fd, stop_read), name="sexpgpu-signals", daemon=True
        )
        self._thread.start()
        # Python prints an Interrupted it drops (in a __del__, an import lock's weakref
        # callback) as a traceback: noise, since interrupt_if_stopping raises it again.
        self._previous_unraisable = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        for signum in HANDLED:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._armed = True
        with self._lock:  # noted, not counted: the pipe may have counted it already
            for signum in list(arrived):  # after the handlers: none is missed in between
                self._note(signum)

    def interrupt_if_stopping(self) -> None:
        """Raise :class:`Interrupted` now if a signal came and the loop has not started: one
        that came while installing, or one swallowed (raised in a ``__del__``, only printed)."""
        with self._lock:
            due = self.stopping and self.raise_now and not self._ended
            self._raised = self._raised or due
        if due:
            raise Interrupted(self.signum or signal.SIGTERM)

    def uninstall(self) -> None:
        """Give the signals back to whoever had them and stop counting."""
        global _installed, _process
        if self._fds:
            signal.set_wakeup_fd(self._previous_wakeup)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()
        if sys.unraisablehook == self._unraisable:
            sys.unraisablehook = self._previous_unraisable
        if self._fds:
            os.write(self._fds[3], b"x")
            if self._thread is not None:
                self._thread.join()
            for fd in self._fds:
                os.close(fd)
            self._fds, self._thread = (), None
        if _installed is self:
            _installed = None
        if _process is self:
            _process = None

    def _forget_in_child(self) -> None:
        # A forked child is not the run: its signals must neither reach this
        # process's pipe (they would count as ours) nor be held back from it.
        with contextlib.suppress(ValueError):  # forked from a thread: not the child's main one
            signal.set_wakeup_fd(-1)
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)  # type: ignore[arg-type]
        for fd in self._fds:
            os.close(fd)
        self._previous, self._fds, self._thread = {}, (), None

    def _note(self, signum: int) -> None:
        # Idempotent, so the handler and the watcher may both note one delivery.
        if signum == signal.SIGHUP:
            self._hup = True
        elif self._first_fatal is None:
            self._first_fatal = signum
            self._fatal_seen.set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler: main thread, once per burst of deliveries."""
        with self._lock:
            if self._ended:
                return
            self._note(signum)
            raise_now = self.raise_now and self._armed and not self._raised
            if raise_now and self._fds and _no_place_to_raise(frame):
                os.write(self._fds[3], bytes([signum]))  # send it again (module docstring)
                return
            self._raised = self._raised or raise_now
        if raise_now:
            raise Interrupted(self.signum or signum)

    def _unraisable(self, unraisable: sys.UnraisableHookArgs) -> None:
        if not isinstance(unraisable.exc_value, Interrupted) or not self._fds:
            return self._previous_unraisable(unraisable)
        with self._lock:
            self._raised = False
            os.write(self._fds[3], bytes([unraisable.exc_value.signum]))  # send it again

    def _send_again(self, signum: int) -> None:
        with self._lock:
            if self.raise_now and not self._ended and not self._raised:
                self._echoes += 1  # the pipe counts this one too
                # a real delivery, unlike _thread.interrupt_main: it wakes a sleeping call
                signal.pthread_kill(threading.main_thread().ident or 0, signum)

    def _delivered(self, signum: int) -> None:
        """One delivery, read from the pipe by the watcher thread."""
        with self._lock:
            if self._ended or signum not in HANDLED:
                return
            if self._echoes:
                self._echoes -= 1
                return
            if signum in _FATAL_ON_SECOND:
                self._fatal_deliveries += 1
                if self._fatal_deliveries > 1:  # ends at once, draining and writing nothing more
                    os._exit(128 + signum)
            self._note(signum)

    def _watch(self, read_fd: int, stop_fd: int) -> None:
        while True:
            ready, _, _ = select.select([read_fd, stop_fd], [], [])
            if stop_fd in ready:
                asked = os.read(stop_fd, 256)
                if b"x" in asked:
                    return
                time.sleep(0.001)  # the main thread moves on meanwhile
                self._send_again(asked[-1])  # asked by the handler or the hook
                continue
            try:
                data = os.read(read_fd, 256)
            except BlockingIOError:
                continue
            for signum in data:
                self._delivered(signum)


_installed: StopWatch | None = None  # the watch whose handlers are in place (a fork undoes it)
_process: StopWatch | None = None  # the watch the console script installed for the process


def watch_process(arrived: Iterable[int] = ()) -> StopWatch:
    """Install the process's watch (the console script, first thing); kept until exit."""
    global _process
    if _process is None:
        watch = StopWatch()
        watch.install(arrived)
        _process = watch
    return _process


def _no_place_to_raise(frame: FrameType | None) -> bool:
    # the import system (module docstring), or this module (the hook would drop it)
    file = frame.f_code.co_filename if frame is not None else ""
    return ("importlib" in file and "_bootstrap" in file) or file == __file__


def process_watch() -> StopWatch | None:
    """The watch :func:`watch_process` installed, or ``None`` (a library caller)."""
    return _process


def _after_fork_in_child() -> None:
    global _installed, _process
    if _installed is not None:
        _installed._forget_in_child()
    _installed = _process = None


os.register_at_fork(after_in_child=_after_fork_in_child)
